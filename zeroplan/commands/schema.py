"""`zeroplan schema COMMAND`: the JSON Schema of what ``COMMAND --json`` prints.

Generated from the pydantic result models, so the documentation cannot drift from the code.
"""

from __future__ import annotations

import typer
from typing_extensions import Annotated

from zeroplan.commands._common import handle_errors, print_json

__all__ = ["register", "result_schema", "SCHEMA_COMMANDS"]

SCHEMA_COMMANDS = ("estimate", "recommend", "check")


def result_schema(command: str) -> dict:
    """JSON Schema (pydantic ``model_json_schema``, serialization mode) of ``command --json``."""
    from zeroplan._util import InputError

    if command == "estimate":
        from zeroplan.core.plan import EstimateResult as model
    elif command == "recommend":
        from zeroplan.advice.recommend import Recommendation as model
    elif command == "check":
        from zeroplan.advice.check import CheckReport as model
    else:
        raise InputError(f"schema {command!r}: no result model; expected one of {', '.join(SCHEMA_COMMANDS)}")
    return model.model_json_schema(mode="serialization")


def register(app: typer.Typer) -> None:
    @app.command("schema")
    @handle_errors
    def schema_cmd(
        command: Annotated[str, typer.Argument(
            metavar="COMMAND", help=f"One of {', '.join(SCHEMA_COMMANDS)} (check: its --format json report).")],
    ) -> None:
        """Print the JSON Schema of a command's --json output (from its pydantic result model)."""
        print_json(result_schema(command))
