"""Shape audit: int32 offset arithmetic on the presets, HF config loading, and the CLI skin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.audit import (
    DOCS_PAGE,
    INT32_MAX,
    AuditReport,
    ConfigError,
    OperandKind,
    audit_shape,
    first_wrapping_expert,
    load_hf_config,
    min_wrap_tokens,
)
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.records import from_jsonable, to_jsonable
from qmoe_doctor.core.shapes import PRESETS, MoEShape

CONFIGS = Path(__file__).resolve().parent.parent / "fixtures" / "configs"
OPERANDS = ("gate_up.x", "gate_up.w", "gate_up.dw", "gate_up.y", "down.x", "down.w", "down.dw", "down.y")
Q480 = PRESETS["qwen3-coder-480b-a35b"]


# --------------------------------------------------------------------------- arithmetic

# (n, k, first wrapping expert, edge the row covers)
FIRST_EXPERT_CASES = [
    (5120, 6144, 69, "480B fused gate_up: the issue's example (69 * 5120 * 6144 = 2,170,552,320)"),
    (6144, 2560, 137, "480B down: the issue's example"),
    (2560, 6144, 137, "transposed down (dx reads w as K x N): same product, same expert"),
    (3072, 4096, 171, "235B gate_up: wraps only past its 128 experts"),
    (1, 1, 2**31, "one element per expert: the limit itself fits"),
    (2**16, 2**15, 1, "experts of exactly 2**31 elements: expert 0 ends at 2**31 - 1, 1 starts at 2**31"),
    (2**15, 2**15, 2, "experts of 2**30 elements: expert 2's base is exactly 2**31"),
    (2**31, 1, 1, "one expert larger than the limit: expert 1 already wraps"),
]


@pytest.mark.parametrize(("n", "k", "expected", "edge"), FIRST_EXPERT_CASES)
def test_first_wrapping_expert(n: int, k: int, expected: int, edge: str) -> None:
    e = first_wrapping_expert(n, k)
    assert e == expected, edge
    assert e * n * k > INT32_MAX
    assert (e - 1) * n * k <= INT32_MAX


def test_first_wrapping_expert_is_none_when_the_stack_fits() -> None:
    assert first_wrapping_expert(5120, 6144, num_experts=160) == 69
    assert first_wrapping_expert(5120, 6144, num_experts=69) is None  # experts 0..68 only
    assert first_wrapping_expert(5120, 6144, num_experts=70) == 69
    assert first_wrapping_expert(3072, 4096, num_experts=128) is None


@pytest.mark.parametrize(("n", "k"), [(0, 10), (10, 0), (-1, 5)])
def test_first_wrapping_expert_rejects_empty_dims(n: int, k: int) -> None:
    with pytest.raises(ValueError):
        first_wrapping_expert(n, k)


def test_480b_examples_from_the_issue() -> None:
    report = audit_shape(Q480, 16384)
    gate_up = report.row("gate_up.w")
    assert gate_up.shape == (160, 5120, 6144)
    assert gate_up.wraps
    assert gate_up.first_wrap == "expert 69"
    assert gate_up.first_wrap_index == 69
    assert gate_up.max_offset == 160 * 5120 * 6144 - 1 == 5_033_164_799
    assert gate_up.straddle_index == 68  # base 2,139,095,040 fits, its tail passes 2**31 - 1
    down = report.row("down.w")
    assert down.shape == (160, 6144, 2560)
    assert (down.first_wrap, down.first_wrap_index, down.straddle_index) == ("expert 137", 137, 136)
    assert down.max_offset == 160 * 6144 * 2560 - 1
    # dW stacks have the weights' shapes
    assert report.row("gate_up.dw").first_wrap == "expert 69"
    assert report.row("down.dw").first_wrap == "expert 137"
    # activations fit at 16384 tokens (131072 sorted rows)
    assert report.sorted_rows == 16384 * 8
    for name in ("gate_up.x", "gate_up.y", "down.x", "down.y"):
        row = report.row(name)
        assert not row.wraps and row.first_wrap is None and row.straddle_index is None
    assert {r.operand for r in report.wrapping} == {"gate_up.w", "gate_up.dw", "down.w", "down.dw"}


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_operand_matches_the_definitions(name: str) -> None:
    shape = PRESETS[name]
    tokens = 16384
    report = audit_shape(shape, tokens)
    assert tuple(r.operand for r in report.rows) == OPERANDS
    rows, e, h, i = tokens * shape.top_k, shape.num_experts, shape.hidden, shape.intermediate
    expected_shapes = {
        "gate_up.x": (rows, h),
        "gate_up.w": (e, 2 * i, h),
        "gate_up.dw": (e, 2 * i, h),
        "gate_up.y": (rows, 2 * i),  # the intermediate activation
        "down.x": (rows, i),
        "down.w": (e, h, i),
        "down.dw": (e, h, i),
        "down.y": (rows, h),
    }
    for row in report.rows:
        assert row.shape == expected_shapes[row.operand]
        numel = 1
        for d in row.shape:
            numel *= d
        assert row.max_offset == numel - 1
        assert row.index_stride == numel // row.shape[0]
        assert row.limit == INT32_MAX
        assert row.wraps == (row.max_offset > INT32_MAX)
        assert row.kind is (OperandKind.EXPERT_STACK if len(row.shape) == 3 else OperandKind.ACTIVATION)
        if row.first_wrap_index is not None:
            assert row.first_wrap_index * row.index_stride > INT32_MAX
            assert (row.first_wrap_index - 1) * row.index_stride <= INT32_MAX
            assert row.first_wrap_index < row.shape[0]
        if row.kind is OperandKind.EXPERT_STACK:
            assert row.wrap_tokens is None
            n, k = row.shape[1:]
            assert row.first_wrap_index == first_wrapping_expert(n, k, num_experts=e)


@pytest.mark.parametrize(
    ("name", "wrapping_stacks"),
    [
        ("tiny", set()),
        ("qwen3-30b-a3b", set()),
        ("qwen3-235b-a22b", set()),  # 128 x 3072 x 4096 = 1.61e9 fits
        ("qwen3-coder-480b-a35b", {"gate_up.w", "gate_up.dw", "down.w", "down.dw"}),
    ],
)
def test_which_presets_wrap_at_the_default_tokens(name: str, wrapping_stacks: set[str]) -> None:
    report = audit_shape(PRESETS[name], 16384)
    assert {r.operand for r in report.wrapping} == wrapping_stacks
    assert report.wraps == bool(wrapping_stacks)


# (preset, smallest wrapping token count, operands that wrap first, edge)
THRESHOLD_CASES = [
    ("qwen3-30b-a3b", 131073, ("gate_up.x", "down.y"), "8 x 2048 per token: 2**31 divides exactly"),
    ("qwen3-235b-a22b", 65537, ("gate_up.x", "down.y"), "8 x 4096 per token"),
    ("qwen3-coder-480b-a35b", 43691, ("gate_up.x", "down.y"), "8 x 6144 per token, not a power of 2"),
    ("tiny", 16777217, ("gate_up.x", "gate_up.y", "down.y"), "hidden == 2 * intermediate: a three-way tie"),
]


@pytest.mark.parametrize(("name", "threshold", "operands", "edge"), THRESHOLD_CASES)
def test_smallest_token_count_at_which_activations_wrap(
    name: str, threshold: int, operands: tuple[str, ...], edge: str
) -> None:
    shape = PRESETS[name]
    report = audit_shape(shape, 1)
    assert report.min_wrap_tokens == threshold, edge
    assert report.min_wrap_operands == operands
    below = audit_shape(shape, threshold - 1)
    at = audit_shape(shape, threshold)
    for op in operands:
        assert not below.row(op).wraps, f"{op} must fit at {threshold - 1} tokens"
        assert at.row(op).wraps, f"{op} must wrap at {threshold} tokens"
    # the widest activation is the first: nothing wraps below the threshold
    assert not any(r.wraps for r in below.rows if r.kind is OperandKind.ACTIVATION)


def test_min_wrap_tokens_edges() -> None:
    # 2**31 = 131072 * 8 * 2048: at 131072 tokens the last offset is exactly 2**31 - 1 (fits)
    assert min_wrap_tokens(8, 2048) == 131073
    assert audit_shape(PRESETS["qwen3-30b-a3b"], 131072).row("down.y").max_offset == INT32_MAX
    assert min_wrap_tokens(1, 1) == 2**31 + 1  # 2**31 one-element rows end at offset 2**31 - 1
    assert min_wrap_tokens(1, 2**31) == 2  # one row of 2**31 elements just fits
    assert min_wrap_tokens(1, 2**31 + 1) == 1
    with pytest.raises(ValueError):
        min_wrap_tokens(0, 2048)


def test_activation_rows_name_the_first_wrapping_row() -> None:
    # 30B at 1M tokens: rows * 2048 with row 1048576 = 2**31 / 2048 the first whose base passes
    report = audit_shape(PRESETS["qwen3-30b-a3b"], 2**20)
    row = report.row("down.y")
    assert row.wraps
    assert row.first_wrap == "row 1048576"
    assert row.first_wrap_index == 1_048_576
    assert row.straddle_index == 1_048_576  # 2**31 is a multiple of 2048: no straddling row
    assert row.wrap_tokens == 131073


def test_activation_that_wraps_only_in_its_last_row_says_tail_only() -> None:
    # top-1 routing, 349526 rows of 6144: the last row starts at 2,147,475,456 (fits) and ends
    # past 2**31 - 1, so no row's base offset wraps, only the elements of the last row
    shape = MoEShape(name="top1", num_experts=8, top_k=1, hidden=6144, intermediate=64)
    report = audit_shape(shape, 349526)
    row = report.row("gate_up.x")
    assert row.wraps
    assert row.first_wrap_index is None
    assert row.straddle_index == 349525 == row.shape[0] - 1
    assert row.first_wrap == "row 349525 (tail only)"
    assert 349525 * 6144 <= INT32_MAX < 349526 * 6144 - 1


def test_bad_token_count() -> None:
    with pytest.raises(ValueError):
        audit_shape(Q480, 0)


def test_report_round_trips_through_json() -> None:
    report = audit_shape(Q480, 50000)
    data = json.loads(json.dumps(to_jsonable(report)))
    assert data["rows"][1]["kind"] == "expert-stack"
    again = from_jsonable(AuditReport, data)
    assert again == report


# --------------------------------------------------------------------------- configs

GOOD_CONFIGS = [
    ("qwen3-30b-a3b.json", (128, 8, 2048, 768, True), "a full Qwen3-MoE config.json"),
    ("qwen3-coder-480b-a35b.json", (160, 8, 6144, 2560, True), "named by _name_or_path"),
    ("nested-text-config.json", (128, 8, 2048, 768, False), "VL model: keys under text_config"),
    ("deepseek-style-n-routed-experts.json", (256, 8, 7168, 2048, True), "n_routed_experts alias"),
]


@pytest.mark.parametrize(("fname", "expected", "edge"), GOOD_CONFIGS)
def test_load_hf_config(fname: str, expected: tuple[int, int, int, int, bool], edge: str) -> None:
    shape = load_hf_config(CONFIGS / fname)
    got = (shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, shape.norm_topk_prob)
    assert got == expected, edge


def test_config_shape_audits_like_the_preset() -> None:
    shape = load_hf_config(CONFIGS / "qwen3-coder-480b-a35b.json")
    assert shape.name == "Qwen/Qwen3-Coder-480B-A35B-Instruct"
    from_config = audit_shape(shape, 16384)
    from_preset = audit_shape(Q480, 16384)
    assert from_config.rows == from_preset.rows


# (file, fragments the message must contain, edge)
BAD_CONFIGS = [
    ("bad-missing-moe-intermediate-size.json", ["missing key 'moe_intermediate_size'"], "missing key"),
    ("bad-dense-model.json", ["missing key 'num_experts'", "n_routed_experts"], "a dense model"),
    ("bad-nested-missing-key.json", ["missing key 'text_config.num_experts_per_tok'"], "nested"),
    ("bad-trailing-comma.json", ["not valid JSON", "line 6", "column 1"], "malformed JSON"),
    ("bad-string-hidden-size.json", ["'hidden_size'", "positive integer", "'6144' (str)"], "string"),
    ("bad-float-top-k.json", ["'num_experts_per_tok'", "8.5 (float)"], "float"),
    ("bad-bool-hidden-size.json", ["'hidden_size'", "True (bool)"], "bool is not an int here"),
    ("bad-zero-experts.json", ["'num_experts'", "positive integer, got 0"], "non-positive"),
    ("bad-norm-topk-prob.json", ["'norm_topk_prob'", "true or false"], "optional key, wrong type"),
    ("bad-top-k-over-experts.json", ["(8) is larger than the expert count (4)"], "top_k > E"),
    ("bad-not-an-object.json", ["expected a JSON object", "list"], "a JSON array"),
    ("no-such-file.json", ["no such file"], "missing file"),
]


@pytest.mark.parametrize(("fname", "fragments", "edge"), BAD_CONFIGS)
def test_bad_configs_name_file_and_key(fname: str, fragments: list[str], edge: str) -> None:
    path = CONFIGS / fname
    with pytest.raises(ConfigError) as info:
        load_hf_config(path)
    message = str(info.value)
    assert str(path) in message, edge
    for fragment in fragments:
        assert fragment in message, f"{edge}: {fragment!r} not in {message!r}"
    assert isinstance(info.value, ValueError)


def test_config_directory_and_non_utf8(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_hf_config(tmp_path)
    binary = tmp_path / "config.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_hf_config(binary)


def test_text_config_must_be_an_object(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"text_config": "oops", "num_experts": 8}))
    with pytest.raises(ConfigError, match="'text_config' must be an object"):
        load_hf_config(cfg)


# --------------------------------------------------------------------------- CLI

runner = CliRunner()
WIDE = {"COLUMNS": "200"}


def test_cli_default_audits_every_preset() -> None:
    result = runner.invoke(app, ["audit"], env=WIDE)
    assert result.exit_code == ExitCode.HEALTHY, result.output
    for name in PRESETS:
        assert name in result.stdout
    assert "expert 69" in result.stdout
    assert "expert 137" in result.stdout
    assert "cast the index to int64 where the product is formed" in result.stdout.lower()
    assert DOCS_PAGE in result.stdout
    assert "43,691 tokens" in result.stdout


def test_cli_one_preset_without_wraps_says_no_fix() -> None:
    result = runner.invoke(app, ["audit", "--preset", "qwen3-30b-a3b"], env=WIDE)
    assert result.exit_code == 0
    assert "qwen3-30b-a3b" in result.stdout
    assert "qwen3-coder" not in result.stdout
    assert "WRAPS" not in result.stdout
    assert "131,073 tokens" in result.stdout


def test_cli_tokens_make_activations_wrap() -> None:
    result = runner.invoke(app, ["audit", "-p", "qwen3-30b-a3b", "--tokens", str(2**20)], env=WIDE)
    assert result.exit_code == 0
    assert "row 1048576" in result.stdout
    assert "WRAPS" in result.stdout


def test_cli_json() -> None:
    result = runner.invoke(app, ["audit", "-p", "qwen3-coder-480b-a35b", "-p", "tiny", "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["kind"] == "audit"
    assert doc["schema_version"] == 1
    assert doc["tokens"] == 16384
    assert [r["shape_name"] for r in doc["reports"]] == ["qwen3-coder-480b-a35b", "tiny"]
    rows = {r["operand"]: r for r in doc["reports"][0]["rows"]}
    assert rows["gate_up.w"]["first_wrap"] == "expert 69"
    assert rows["gate_up.w"]["wraps"] is True
    assert rows["down.w"]["first_wrap_index"] == 137
    assert rows["gate_up.x"]["wraps"] is False
    assert doc["reports"][0]["min_wrap_tokens"] == 43691
    assert from_jsonable(AuditReport, doc["reports"][0]) == audit_shape(Q480, 16384)


def test_cli_config_file() -> None:
    path = CONFIGS / "nested-text-config.json"
    result = runner.invoke(app, ["audit", "--config", str(path), "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    (report,) = doc["reports"]
    assert report["source"] == str(path)
    assert report["shape"]["num_experts"] == 128


def test_cli_preset_and_config_together() -> None:
    args = ["audit", "-p", "tiny", "-c", str(CONFIGS / "qwen3-coder-480b-a35b.json"), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0
    names = [r["shape_name"] for r in json.loads(result.stdout)["reports"]]
    assert names == ["tiny", "Qwen/Qwen3-Coder-480B-A35B-Instruct"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["-p", "qwen9"], ["unknown preset 'qwen9'", "qwen3-30b-a3b"]),
        (["-c", str(CONFIGS / "bad-trailing-comma.json")], ["not valid JSON", "line 6"]),
        (["-c", str(CONFIGS / "bad-missing-moe-intermediate-size.json")], ["moe_intermediate_size"]),
        (["-c", str(CONFIGS / "bad-string-hidden-size.json")], ["hidden_size"]),
        (["-c", str(CONFIGS / "no-such-file.json")], ["no such file"]),
    ],
)
def test_cli_usage_errors_exit_2_without_traceback(args: list[str], fragments: list[str]) -> None:
    result = runner.invoke(app, ["audit", *args, "--json"], env=WIDE)
    assert result.exit_code == ExitCode.USAGE
    assert result.stdout == ""  # nothing on the machine channel
    assert "Traceback" not in result.output
    assert "error:" in result.stderr
    flat = " ".join(result.stderr.split())
    for fragment in fragments:
        assert fragment in flat


def test_cli_rejects_zero_tokens() -> None:
    result = runner.invoke(app, ["audit", "--tokens", "0"])
    assert result.exit_code == ExitCode.USAGE


def test_shape_type_is_the_preset_record() -> None:
    assert isinstance(load_hf_config(CONFIGS / "qwen3-30b-a3b.json"), MoEShape)
