"""Issue 11 §2.4–2.8, 2.11, 2.12 and issue 17 §6: the CLI's shared options and its front door."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from zeroplan.cli import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()
H = str(REPO / "hardware_profiles" / "dgx-a100-80gb.toml")


def invoke(args: list[str], **kw):
    return runner.invoke(app, args, catch_exceptions=False, **kw)


def one_error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# ------------------------------------------------------------------ §2.4 configs DeepSpeed refuses
REFUSED = {
    "stage 9": ({"zero_optimization": {"stage": 9}}, "zero_optimization.stage", "9"),
    "stage two": ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage", '"two"'),
    "negative bucket": ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}},
                        "zero_optimization.reduce_bucket_size", "-1"),
    "fractional bucket": ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1.5}},
                          "zero_optimization.reduce_bucket_size", "1.5"),
    "fp16 and bf16": ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16", "bf16"),
    "offload device": ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
                       "zero_optimization.offload_optimizer.device", '"gpu"'),
}


def _write(tmp_path: Path, body: dict) -> Path:
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, **body}, indent=2) + "\n")
    return p


def _line_of(path: Path, key: str) -> int:
    leaf = "enabled" if key == "fp16" else key.split(".")[-1]  # DS005 points at fp16.enabled
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if f'"{leaf}"' in ln)


@pytest.fixture(scope="module")
def deepspeed_config_cls():
    ds = pytest.importorskip("deepspeed.runtime.config")
    return ds.DeepSpeedConfig


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_deepspeed_itself_refuses_each_case(case, deepspeed_config_cls):
    """The premise, checked against DeepSpeed 0.19.8 itself (constructed on CPU)."""
    body = REFUSED[case][0]
    with pytest.raises(Exception):
        deepspeed_config_cls({"train_micro_batch_size_per_gpu": 1, **body})


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("command", ["estimate", "recommend", "report"])
def test_refused_config_exits_2_naming_file_line_key_value(tmp_path, case, command):
    body, key, value = REFUSED[case]
    path = _write(tmp_path, body)
    r = invoke([command, "-m", "llama-2-7b", "-H", H, "--gpus", "8", "--ds-config", str(path)])
    line = one_error_line(r)
    assert f"{path}:{_line_of(path, key)}:" in line
    assert key in line and value in line
    assert "expected" in line or "cannot be simultaneously enabled" in line
    assert r.stdout == ""


@pytest.mark.parametrize("case", ["stage 9", "fractional bucket", "fp16 and bf16"])
def test_lenient_plans_anyway_and_check_still_fails(tmp_path, case):
    path = _write(tmp_path, REFUSED[case][0])
    r = invoke(["estimate", "-m", "llama-2-7b", "-H", H, "--gpus", "8", "--ds-config", str(path), "--lenient", "--json"])
    assert r.exit_code == 0, r.output
    assert any(f["severity"] == "error" for f in json.loads(r.stdout)["ds_config_findings"])
    r = invoke(["check", str(path), "-m", "llama-2-7b", "-H", H, "--gpus", "8"])
    assert r.exit_code == 1, r.output


# ------------------------------------------------------------------ §2.5 check gates an HF config
def test_check_takes_precision_for_an_hf_auto_config(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 2}}
    path = tmp_path / "hf.json"
    path.write_text(json.dumps(cfg))
    base = ["check", str(path), "-m", "llama-2-7b", "-H", H, "--gpus", "8", "--format", "json"]
    plain = json.loads(invoke(base).stdout)["files"][0]["plan"]
    assert plain["precision"] == "fp32"
    r = invoke(base + ["--precision", "bf16", "--micro-batch", "2", "--seq-len", "1024", "--grad-accum", "4"])
    plan = json.loads(r.stdout)["files"][0]["plan"]
    assert (plan["precision"], plan["micro_batch"], plan["grad_accum"]) == ("bf16", 2, 4)
    assert plan["peak_bytes"] < plain["peak_bytes"]


def test_stage_is_one_option_everywhere():
    a = json.loads(invoke(["estimate", "-m", "7B", "--gpus", "8", "--stage", "2,3", "--json"]).stdout)
    b = json.loads(invoke(["estimate", "-m", "7B", "--gpus", "8", "--stage", "3", "--stage", "2", "--json"]).stdout)
    assert [s["stage"] for s in a["stages"]] == [s["stage"] for s in b["stages"]] == [2, 3]
    line = one_error_line(invoke(["estimate", "-m", "7B", "--stage", "4"]))
    assert "--stage" in line and "4" in line


def test_headroom_has_one_name_and_the_old_one_is_a_hidden_alias(tmp_path):
    path = REPO / "examples" / "configs" / "broken.json"
    help_text = invoke(["check", "--help"]).stdout
    assert "--headroom" in help_text and "--min-headroom" not in help_text
    # --seq-len 1024: the config fits (ZP103 needs a plan that fits), with less than 90% left free
    a = invoke(["check", str(path), "-m", "llama-2-7b", "-H", H, "--gpus", "8", "--seq-len", "1024", "--headroom", "0.9",
                "-f", "json"])
    b = invoke(["check", str(path), "-m", "llama-2-7b", "-H", H, "--gpus", "8", "--seq-len", "1024",
                "--min-headroom", "0.9", "-f", "json"])
    rules = lambda r: sorted(x["rule_id"] for x in json.loads(r.stdout)["files"][0]["findings"])  # noqa: E731
    assert "ZP103" in rules(a) and rules(a) == rules(b)


# ------------------------------------------------------------------ §2.6 emit -> check round trip
def test_emitted_config_passes_check_with_default_flags(tmp_path, deepspeed_config_cls):
    out = tmp_path / "emitted.json"
    args = ["-m", "llama-2-70b", "-H", str(REPO / "hardware_profiles" / "dgx-h100.toml"), "--nodes", "4"]
    r = invoke(["recommend", *args, "-p", "bf16", "--seq-len", "4096", "--emit-config", str(out), "--json"])
    assert r.exit_code == 0, r.output
    chosen = json.loads(r.stdout)["chosen"]
    cfg = json.loads(out.read_text())
    assert cfg["zeroplan"]["seq_len"] == 4096 and cfg["zeroplan"]["checkpointing"] == chosen["checkpointing"]
    if chosen["checkpointing"] == "full":
        assert "activation_checkpointing" in cfg
    r = invoke(["check", str(out), *args, "-f", "json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["counts"]["error"] == 0 and report["counts"]["warning"] == 0
    assert report["files"][0]["plan"]["checkpointing"] == chosen["checkpointing"]
    # explicit flags win over the recorded values
    r = invoke(["check", str(out), *args, "-f", "json", "--checkpointing", "none", "--seq-len", "8192"])
    assert json.loads(r.stdout)["files"][0]["plan"]["checkpointing"] == "none"
    # DeepSpeed 0.19.8 accepts the file, zeroplan key included (world size 1 on CPU: batch fixed up)
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    ds = deepspeed_config_cls(cfg)
    assert ds.zero_optimization_stage == cfg["zero_optimization"]["stage"]


def test_bad_zeroplan_block_is_one_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_micro_batch_size_per_gpu": 1,\n  "zeroplan": {\n    "seq_len": -3\n  }\n}\n')
    line = one_error_line(invoke(["estimate", "-m", "7B", "--gpus", "8", "--ds-config", str(path)]))
    assert f"{path}:4:" in line and "zeroplan.seq_len = -3" in line and "positive integer" in line


def test_a_typo_in_the_zeroplan_block_is_one_line_not_the_defaults(tmp_path):
    """``seq_length`` for ``seq_len``: the block's unknown keys were skipped, so a 65,536-token plan ran at the
    default 2,048 tokens without a word, --strict or not, and check judged the wrong sequence."""
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_micro_batch_size_per_gpu": 1,\n  "zeroplan": {\n    "seq_length": 65536\n  }\n}\n')
    line = one_error_line(invoke(["estimate", "-m", "7B", "--gpus", "8", "--ds-config", str(path)]))
    assert f"{path}:4:" in line and "zeroplan.seq_length is not a key" in line and "seq_len" in line
    r = invoke(["check", str(path), "-m", "7B", "-H", "dgx-h100", "--gpus", "8", "-f", "json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["files"][0]["findings"][0]["rule_id"] == "ZP000"


# ------------------------------------------------------------------ §2.7 schema and README keys
def _resolve(schema: dict, node: dict, parts: list[str]) -> bool:
    defs = schema.get("$defs", {})

    def deref(n: dict) -> list[dict]:
        if "$ref" in n:
            return deref(defs[n["$ref"].split("/")[-1]])
        if "anyOf" in n or "oneOf" in n:
            return [x for b in n.get("anyOf", n.get("oneOf")) for x in deref(b)]
        return [n]

    if not parts:
        return True
    head, rest = parts[0], parts[1:]
    for n in deref(node):
        if head == "[]":
            if n.get("type") == "array" and _resolve(schema, n.get("items", {}), rest):
                return True
            continue
        if head in n.get("properties", {}) and _resolve(schema, n["properties"][head], rest):
            return True
        if n.get("type") == "object" and "properties" not in n and n.get("additionalProperties", True) is not False:
            return True  # a free-form dict: any key
    return False


def _readme_schema_keys(heading: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    m = re.search(rf"^#### `{re.escape(heading)}` schema\n(.*?)(?=^#)", text, re.S | re.M)
    assert m, f"README has no '#### `{heading}` schema' section"
    keys: list[str] = []
    for row in re.findall(r"^\| (.+?) \|", m.group(1), re.M):
        base = ""
        for tok in re.findall(r"`([^`]+)`", row):
            if tok.startswith("."):
                tok = base + tok
            else:
                base = tok.rsplit(".", 1)[0] if "." in tok else tok
            for t in re.sub(r"\.\{([^}]*)\}$", lambda mm: "|" + mm.group(1), tok).split("|")[:1]:
                keys.append(t)
    return keys


@pytest.mark.parametrize("command,heading", [("estimate", "estimate --json"), ("recommend", "recommend --json"),
                                             ("check", "check --format json")])
def test_every_readme_json_key_is_in_the_schema(command, heading):
    r = invoke(["schema", command])
    assert r.exit_code == 0, r.output
    schema = json.loads(r.stdout)
    keys = _readme_schema_keys(heading)
    assert len(keys) >= 5
    missing = [k for k in keys if not _resolve(schema, schema, k.replace("[]", ".[]").split("."))]
    assert not missing, f"README names keys the {command} result does not have: {missing}"


def test_schema_rejects_a_missing_key_so_the_readme_test_can_fail():
    schema = json.loads(invoke(["schema", "recommend"]).stdout)
    assert _resolve(schema, schema, ["chosen", "micro_batch"])
    assert not _resolve(schema, schema, ["choice"]) and not _resolve(schema, schema, ["per_stage"])


# ------------------------------------------------------------------ §2.8 no wrapping off a terminal
def test_non_tty_output_keeps_each_finding_on_one_line():
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run([sys.executable, "-m", "zeroplan", "check", str(REPO / "examples" / "configs" / "broken.json"),
                        "-m", "llama-2-7b", "-H", H, "--nodes", "1"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert p.returncode == 1, p.stderr
    ds001 = [ln for ln in p.stdout.splitlines() if " DS001 " in ln]
    assert len(ds001) == 1 and len(ds001[0]) > 80
    assert ds001[0].rstrip().endswith("did you mean 'contiguous_gradients'?")


# ------------------------------------------------------------------ §2.11 Hub ids
def test_hub_id_resolves_to_the_catalog():
    r = invoke(["models", "show", "meta-llama/Meta-Llama-3-70B", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["name"] == "llama-3-70b"
    assert json.loads(invoke(["models", "show", "meta-llama/meta-llama-3-70b-instruct", "--json"]).stdout)["name"] == "llama-3-70b"


def test_hub_id_reads_the_local_cache_and_never_the_network(tmp_path, monkeypatch):
    cfg = (REPO / "examples" / "models" / "tinyllama-1.1b" / "config.json").read_text()
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "config.json").write_text(cfg)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    r = invoke(["models", "show", "acme/tiny-llama", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["params"] == 1_100_048_384  # TinyLlama-1.1B's published count
    # HF_HUB_CACHE wins over HF_HOME; a snapshot without refs/main is still found
    other = tmp_path / "other"
    (other / "models--acme--tiny-llama" / "snapshots" / "ff").mkdir(parents=True)
    (other / "models--acme--tiny-llama" / "snapshots" / "ff" / "config.json").write_text(cfg)
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert invoke(["models", "show", "acme/tiny-llama", "--json"]).exit_code == 0
    line = one_error_line(invoke(["models", "show", "acme/not-cached"]))
    assert "acme/not-cached" in line and str(other) in line and "never downloads" in line


# ------------------------------------------------------------------ §2.12 --help
def _commands():
    root = get_command(app)
    out = []

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            out.append((path, cmd))

    walk(root, [])
    return out


PLANNING = {"estimate", "recommend", "check", "report"}


@pytest.mark.parametrize("path,cmd", _commands(), ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_help_lists_every_option_with_help_and_default(path, cmd):
    r = invoke([*path, "--help"])
    assert r.exit_code == 0, r.output
    text = r.stdout
    assert "<bool>" not in text and "╭" not in text
    opts_text = text[text.index("\nOptions:"):]
    for p in cmd.params:
        if p.param_type_name != "option" or p.hidden or p.name == "help":
            continue
        if not (p.help and p.help.strip()) and path[0] == "bench":
            pytest.xfail(f"bench {p.opts[0]} has no help text (commands/bench.py is the bench work's)")
        assert p.help and p.help.strip(), f"{' '.join(path)} {p.opts[0]}: no help text"
        for opt in p.opts + p.secondary_opts:
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", opts_text), f"{opt} missing or cut in help"
        if path[0] in PLANNING:
            long_name = next(o for o in p.opts if o.startswith("--"))  # the entry's name; aliases follow it
            m = re.search(rf"^  (?:-\w, )?{re.escape(long_name)}(?![\w-]).*?(?=^  -|\Z)", opts_text, re.S | re.M)
            assert m, f"{long_name} has no entry of its own in {' '.join(path)} --help"
            assert "[default:" in m.group(0) or "[required]" in m.group(0), f"{' '.join(path)} {long_name}: no default"


# ------------------------------------------------------------------ issue 17 §6: usage errors
@pytest.mark.parametrize("args,needle", [
    (["estimate", "--model", "7B", "--bogus"], "--bogus"),
    (["estimate", "--model", "7B", "--gpus", "abc"], "abc"),
    (["estimate", "--model"], "--model"),
    (["check"], "CONFIG"),
    (["recommend", "-m", "7B", "--headroom", "lots"], "lots"),
    (["nosuchcommand"], "nosuchcommand"),
])
def test_usage_errors_are_one_line(args, needle):
    line = one_error_line(runner.invoke(app, args))
    assert line.startswith("zeroplan: error: ") and needle in line


def test_usage_error_from_the_console_script_is_one_line():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "zeroplan", "estimate", "--model", "7B", "--gpus", "x"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("zeroplan: error: ") and p.stdout == ""


def test_qlora_stage_3_advice_leads_somewhere():
    """At the default fp32 precision the advice was "pass --quant-storage fp32", and following it gave "QLoRA
    computes in bf16 or fp16": a circle. The precision is asked for first; then the storage that matches it,
    and that plan runs."""
    base = ["estimate", "-m", "llama-2-7b", "--method", "qlora", "-H", "dgx-h100", "--stage", "3"]
    assert "give --precision bf16 or fp16" in one_error_line(invoke(base))
    line = one_error_line(invoke([*base, "--precision", "bf16"]))
    assert "pass --quant-storage bf16" in line
    r = invoke([*base, "--precision", "bf16", "--quant-storage", "bf16"])
    assert r.exit_code == 0, r.output[-600:]


def test_a_lora_rank_of_zero_is_refused_not_full_fine_tuning():
    line = one_error_line(invoke(["estimate", "-m", "llama-2-7b", "--lora-r", "0"]))  # planned full, silently
    assert "--lora-r 0: expected a rank from 1 to 65536" in line


def test_a_modules_to_save_name_that_matches_nothing_is_said():
    """PEFT skips such a name (one list often serves several families: embed_tokens, lm_head; real PEFT's counts
    in test_finetune_counts), so the plan does too, but says so: a typo no longer passes without a word."""
    r = invoke(["estimate", "-m", "llama-2-7b", "--method", "lora", "--modules-to-save", "lm_head,bogus"])
    assert r.exit_code == 0, r.output[-600:]
    assert "--modules-to-save bogus: no module of llama-2-7b has that name; PEFT skips it" in r.output
