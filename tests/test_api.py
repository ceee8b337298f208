"""The public Python API (zeroplan/api.py, zeroplan/options.py) and the CLI as a thin shell over it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

import zeroplan
from zeroplan.cli import app
from zeroplan.options import CheckOptions, CommonOptions, PlanOptions, RecommendOptions, ReportOptions

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
CONFIGS = ROOT / "examples" / "configs"
runner = CliRunner()
API_ONLY = {"expandable_segments"}  # PyTorch allocator setting: an API field with no CLI flag yet


def _cli_json(args: list[str]) -> dict:
    r = runner.invoke(app, args)
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)


# ------------------------------------------------------------------ the CLI prints the API's dump
def test_estimate_cli_json_is_the_api_results_dump():
    args = dict(model="llama-2-70b", hardware="dgx-h100", nodes=2, precision="bf16", stage=[2, 3],
                offload_optimizer="cpu", seq_len=4096)
    result = zeroplan.estimate(**args)
    cli = _cli_json(["estimate", "-m", "llama-2-70b", "-H", "dgx-h100", "--nodes", "2", "-p", "bf16", "--stage",
                     "2,3", "--offload-optimizer", "cpu", "--seq-len", "4096", "--json"])
    assert cli == result.model_dump(mode="json")
    assert [p["stage"] for p in cli["stages"]] == [2, 3]


def test_estimate_with_a_ds_config_cli_json_is_the_api_results_dump():
    cfg = str(CONFIGS / "zero3-offload.json")
    result = zeroplan.estimate(model="llama-2-13b", hardware="dgx-a100-80gb", gpus=8, ds_config=cfg)
    assert _cli_json(["estimate", "-m", "llama-2-13b", "-H", "dgx-a100-80gb", "-g", "8", "-c", cfg, "--json"]) == \
        result.model_dump(mode="json")


def test_recommend_cli_json_is_the_api_results_dump():
    rec = zeroplan.recommend(model="llama-2-7b", hardware="dgx-h100", gpus=8, precision="bf16", top=3)
    cli = _cli_json(["recommend", "-m", "llama-2-7b", "-H", "dgx-h100", "-g", "8", "-p", "bf16", "--top", "3",
                     "--json"])
    assert cli == rec.model_dump(mode="json")
    assert cli["chosen"] is not None and cli["ds_config"]["zeroplan"]["seq_len"] == 2048


def test_check_cli_json_is_the_api_reports_dump():
    configs = [str(CONFIGS / "zero2-bf16.json"), str(CONFIGS / "zero3-offload.json")]
    report = zeroplan.check(configs, model="llama-2-13b", hardware="dgx-a100-80gb", nodes=1, fail_on="warning")
    r = runner.invoke(app, ["check", *configs, "-m", "llama-2-13b", "-H", "dgx-a100-80gb", "--nodes", "1",
                            "--fail-on", "warning", "--format", "json"])
    assert r.exit_code == report.exit_code, r.output
    assert json.loads(r.stdout) == report.model_dump(mode="json")
    assert [f["path"] for f in json.loads(r.stdout)["files"]] == configs


def test_report_cli_json_is_the_api_reports_dump():
    data = zeroplan.build_report(model="gpt2", hardware="dgx-a100-80gb", nodes=1, precision="bf16", max_nodes=2)
    cli = _cli_json(["report", "-m", "gpt2", "-H", "dgx-a100-80gb", "--nodes", "1", "-p", "bf16", "--max-nodes", "2",
                     "--json"])
    assert cli == data.model_dump(mode="json")
    assert cli["inputs"] == {"model": "gpt2", "hardware": "dgx-a100-80gb", "nodes": 1, "strict": False,
                             "precision": "bf16"}
    assert data.estimate is not None and len(data.estimate.stages) == 4


def test_nccl_log_cli_json_is_the_api_reports_dump():
    log = str(DATA / "nccl" / "single_node_nvls.log")
    plan = PlanOptions(model="1B", gpus=8, stage=3, precision="bf16")
    result = zeroplan.read_nccl_log(log, plan)
    cli = _cli_json(["nccl-log", log, "-m", "1B", "-g", "8", "--stage", "3", "-p", "bf16", "--json"])
    assert cli == result.model_dump(mode="json")
    assert cli["plan"] == {"stage": 3, "n_gpus": 8, "comm_model": "deepspeed", "model": "1B"}


# ------------------------------------------------------------------ options: keywords, models, defaults
def test_keywords_and_options_model_give_the_same_result():
    opts = PlanOptions(model="llama-2-7b", gpus=8, precision="bf16", stage=3)
    assert zeroplan.estimate(opts) == zeroplan.estimate(model="llama-2-7b", gpus=8, precision="bf16", stage=3)
    # keywords override the options model's fields
    assert [p.stage for p in zeroplan.estimate(opts, stage=[1, 2]).stages] == [1, 2]


def test_unknown_field_and_wrong_option_model_are_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        zeroplan.estimate(model="llama-2-7b", gpu=8)  # typo: gpus
    with pytest.raises(ValidationError):
        zeroplan.check("x.json", model="llama-2-7b", hardware="dgx-h100", stage=3)  # the config sets the stage
    with pytest.raises(TypeError):
        zeroplan.estimate(CheckOptions(model="llama-2-7b"))


@pytest.mark.parametrize("call,kw,needle", [
    (zeroplan.estimate, dict(model="llama-2-7b", comm_model="ring"), "--flavour (--comm-model) 'ring' is unknown"),
    (zeroplan.estimate, dict(model="llama-2-7b", mfu=1.5), "--mfu 1.5 must be in [0.001, 1]"),
    (zeroplan.estimate, dict(model="no-such-model-xyz"), "no-such-model-xyz"),
    (zeroplan.recommend, dict(model="llama-2-7b"), "recommend needs --hardware"),
    (zeroplan.recommend, dict(model="llama-2-7b", hardware="dgx-h100", top=0), "--top 0 must be a positive"),
    (zeroplan.build_report, dict(model="gpt2", max_nodes=0), "--max-nodes 0 must be between 1 and 4096"),
])
def test_mistakes_raise_input_error_with_the_cli_message(call, kw, needle):
    with pytest.raises(zeroplan.InputError) as exc:
        call(**kw)
    assert needle in str(exc.value)


def test_check_without_hardware_is_an_input_error():
    with pytest.raises(zeroplan.InputError, match="check needs --hardware"):
        zeroplan.check([str(CONFIGS / "zero2-bf16.json")], model="llama-2-7b")


def test_a_config_deepspeed_refuses_is_refused_unless_lenient():
    cfg = str(CONFIGS / "broken.json")
    with pytest.raises(zeroplan.InputError, match="refuses this config"):
        zeroplan.estimate(model="llama-2-7b", gpus=8, ds_config=cfg)
    assert zeroplan.estimate(model="llama-2-7b", gpus=8, ds_config=cfg, lenient=True).ds_config_findings


def _params(command: str) -> list:
    return typer.main.get_command(app).commands[command].params


def _param_defaults(command: str) -> dict[str, object]:
    return {p.name: p.default for p in _params(command)}


@pytest.mark.parametrize("command,model", [
    ("estimate", PlanOptions), ("recommend", RecommendOptions), ("check", CheckOptions), ("report", ReportOptions),
    ("nccl-log", PlanOptions),
])
def test_cli_defaults_are_the_api_defaults(command, model):
    """Each default is written once: every CLI option named like an API field has the field's default."""
    defaults = _param_defaults(command)
    aliases = {"nvme": "allow_nvme"}  # (typer names a parameter by its function argument: allow_nvme)
    shared = {aliases.get(k, k): v for k, v in defaults.items() if aliases.get(k, k) in model.model_fields}
    assert len(shared) >= len(CommonOptions.model_fields) - (1 if command == "nccl-log" else 0)
    for name, default in shared.items():
        want = model.model_fields[name].default
        if name == "model":
            continue  # required in the API; optional in nccl-log (a log without a plan)
        assert default == want, (command, name, default, want)


def test_nccl_log_takes_the_shared_planning_options():
    from zeroplan.commands import _common

    estimate_opts = {p.name: (p.opts, p.help) for p in _params("estimate")}
    nccl_opts = {p.name: (p.opts, p.help) for p in _params("nccl-log")}
    for name in set(PlanOptions.model_fields) - API_ONLY:
        assert name in nccl_opts, name
        assert nccl_opts[name] == estimate_opts[name], name  # same flags, same help
    assert _common.OptionalModel is not None
    # a planning option without --model is a mistake (nothing to compare with)
    r = runner.invoke(app, ["nccl-log", str(DATA / "nccl" / "single_node_nvls.log"), "--optimizer", "sgd"])
    assert r.exit_code == 2 and "--optimizer needs --model" in r.output


def test_estimate_report_and_nccl_log_offer_the_plan_options_in_one_order():
    """The plan's flags are declared once (commands/_common.py ``_plan_options``) and --help lists them
    in that order in every command that offers them all."""
    import inspect

    from zeroplan.commands._common import _plan_options

    names = list(inspect.signature(_plan_options).parameters)
    assert len(names) == 23
    for command in ("estimate", "report", "nccl-log"):
        assert [p.name for p in _params(command) if p.name in names] == names, command
    # nccl-log's FILE argument stays first, before the options
    assert _params("nccl-log")[0].name == "file"


# ------------------------------------------------------------------ cheap import, no torch / rich
def test_import_zeroplan_and_planning_imports_no_torch_rich_or_typer():
    code = ("import sys, zeroplan\n"
            "assert 'zeroplan.api' not in sys.modules and 'pydantic' not in sys.modules, 'import zeroplan is not lazy'\n"
            "r = zeroplan.estimate(model='llama-2-7b', gpus=8, precision='bf16')\n"
            "zeroplan.recommend(model='llama-2-7b', hardware='dgx-h100', gpus=8)\n"
            "zeroplan.build_report(model='gpt2', hardware='dgx-h100', max_nodes=2)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'rich', 'typer', 'deepspeed'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_plan_from_a_catalog_name_loads_no_file_reader_and_builds_no_unused_validator():
    """Issue 14 (cold start): the readers load where a file is read, specs models build on first use."""
    code = ("import sys, zeroplan\n"
            "zeroplan.estimate(model='llama-2-70b', gpus=64)\n"
            "readers = ('zeroplan.specs.ds_reader', 'zeroplan.specs.ds_parse', 'zeroplan.specs.hardware_load',\n"
            "           'zeroplan.specs.hardware_toml', 'zeroplan.specs.training_files', 'zeroplan.advice.recommend',\n"
            "           'zeroplan.report.render', 'zeroplan.inspect.nccl_log')\n"
            "loaded = [m for m in readers if m in sys.modules]\n"
            "assert not loaded, loaded\n"
            "from zeroplan.specs.ds_schema import DSConfig, ZeroConfig\n"
            "from zeroplan.specs.hardware_schema import HardwareProfile\n"
            "built = [c.__name__ for c in (DSConfig, HardwareProfile) if c.__pydantic_complete__]\n"
            "assert not built, built\n"
            "assert ZeroConfig.__pydantic_complete__  # used by every plan: built on that first use\n"
            "zeroplan.estimate(model='llama-2-7b', hardware='dgx-h100', gpus=8)\n"
            "assert 'zeroplan.specs.hardware_load' in sys.modules and HardwareProfile.__pydantic_complete__\n"
            "assert 'zeroplan.specs.ds_reader' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_specs_model_is_built_on_first_use():
    """specs/__init__.py: the specs' pydantic models are declared with defer_build (issue 14)."""
    import importlib
    import inspect as pyinspect

    from pydantic import BaseModel

    eager = []
    for path in sorted((ROOT / "zeroplan" / "specs").glob("*.py")):
        mod = importlib.import_module(f"zeroplan.specs.{path.stem}")
        eager += [f"{mod.__name__}.{name}" for name, cls in vars(mod).items()
                  if pyinspect.isclass(cls) and issubclass(cls, BaseModel) and cls.__module__ == mod.__name__
                  and not cls.model_config.get("defer_build")]
    assert not eager, eager


def test_cli_json_path_imports_no_rich_and_only_its_command():
    code = ("import sys\n"
            "from zeroplan.cli import main\n"
            "sys.argv = ['zeroplan', 'estimate', '--model', 'gpt2', '--gpus', '8', '--json']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'rich')\n"
            "             or m.startswith('zeroplan.commands.') and m not in ('zeroplan.commands._common',\n"
            "                                                                'zeroplan.commands.estimate'))\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]["name"] == "gpt2"


def test_every_public_name_resolves():
    for name in zeroplan.__all__:
        assert getattr(zeroplan, name) is not None, name
    assert zeroplan.EstimateResult is zeroplan.estimate.__globals__["EstimateResult"]
    with pytest.raises(AttributeError):
        zeroplan.no_such_name  # noqa: B018


# ------------------------------------------------------------------ commands hold no planning logic
PLANNING_COMMANDS = ("estimate", "recommend", "check", "report", "nccl_log")


@pytest.mark.parametrize("name", PLANNING_COMMANDS)
def test_planning_commands_call_the_api_not_the_library_below(name):
    tree = ast.parse((ROOT / "zeroplan" / "commands" / f"{name}.py").read_text())
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.append(node.module)
        elif isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
    below = [m for m in imported if m.startswith(("zeroplan.core", "zeroplan.advice", "zeroplan.inspect"))]
    assert not below, below
    assert "zeroplan.api" in imported
