import sys
from pathlib import Path

# tests/readme_examples.py is importable from the tests
sys.path.insert(0, str(Path(__file__).resolve().parent))
