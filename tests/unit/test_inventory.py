"""GPU inventory, CUDA ordinal mapping, GPU selection and `qmoe-doctor env`, on a fake NVML.

The fake machines (tests/unit/fake_nvml.py) cover: NVSwitch and direct NVLink, PCIe levels,
three compute capabilities (FASTEST_FIRST differs from PCI order), MIG on one GPU, ECC
counters unsupported on one, an NVML query that is refused, and NVML that cannot start.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest
from fake_nvml import (
    DRIVER_NOT_LOADED,
    GPU_IS_LOST,
    H200_UUIDS,
    LIBRARY_NOT_FOUND,
    MIG_UUIDS,
    MIXED_UUIDS,
    FakeNvml,
    four_mixed,
    two_h200_nvswitch,
)
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.records import from_jsonable, to_json
from qmoe_doctor.machine.inventory import (
    DeviceOrder,
    GpuSelectionError,
    Inventory,
    LinkKind,
    P2PStatus,
    child_cuda_env,
    collect_inventory,
    describe_probe_mapping,
    map_cuda_ordinals,
    parse_visible_devices,
    probe_ordinal,
    select_gpus,
    subset_inventory,
)
from qmoe_doctor.reports.json import json_document

NO_ENV: dict[str, str] = {}
PCI_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Install a fake machine as ``pynvml``; returns the installer."""

    def _install(fake: FakeNvml) -> FakeNvml:
        monkeypatch.setitem(sys.modules, "pynvml", fake.module())
        return fake

    yield _install


@pytest.fixture
def clean_cuda_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI reads os.environ; a GPU machine running these tests may have these set."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


def mixed(install: object, environ: dict[str, str] | None = None) -> Inventory:
    install(four_mixed())  # type: ignore[operator]
    return collect_inventory(environ=NO_ENV if environ is None else environ)


# --- collection ---------------------------------------------------------------------------


def test_two_h200_over_nvswitch(install: object) -> None:
    fake = install(two_h200_nvswitch())  # type: ignore[operator]
    inv = collect_inventory(environ=NO_ENV)
    assert inv.nvml_error is None
    assert [g.index for g in inv.gpus] == [0, 1]
    g0 = inv.gpus[0]
    assert (g0.name, g0.uuid, g0.pci_bus_id) == ("NVIDIA H200", H200_UUIDS[0], "00000000:18:00.0")
    assert g0.compute_capability == (9, 0) and g0.cc_text == "9.0"
    assert g0.memory_total == 141 * 1024**3 and g0.memory_free == 140 * 1024**3
    assert (g0.mig_current, g0.mig_pending, g0.ecc_current) == (False, False, True)
    assert (g0.ecc_volatile_uncorrected, g0.ecc_aggregate_uncorrected) == (0, 0)
    assert g0.retired_pages_sbe is None  # Hopper: page retirement not supported, rows remapped
    assert (g0.remapped_rows_uncorrectable, g0.remap_pending, g0.remap_failure) == (0, False, False)
    pair = inv.pair(0, 1)
    assert pair is not None
    assert (pair.link, pair.nvlinks, pair.via_nvswitch, pair.label) == (LinkKind.NVLINK, 18, True, "NV18")
    assert pair.pcie is LinkKind.NODE
    assert (pair.p2p_read, pair.p2p_write, pair.p2p_nvlink) == (P2PStatus.OK,) * 3
    assert (inv.driver_version, inv.cuda_driver_version) == ("580.95.05", "13.0")
    assert [(o.ordinal, o.nvml_index) for o in inv.cuda_ordinals] == [(0, 0), (1, 1)]
    assert inv.warnings == ()
    assert fake.initialized == 0, "nvmlShutdown must balance nvmlInit"


def test_four_mixed_gpus(install: object) -> None:
    inv = mixed(install)
    assert [g.name for g in inv.gpus] == [
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA H100 PCIe",
        "NVIDIA L4",
    ]
    a100, _, h100, l4 = inv.gpus
    assert (a100.retired_pages_sbe, a100.retired_pages_dbe, a100.retired_pages_pending) == (0, 0, False)
    # MIG on, with its instances listed
    assert (h100.mig_current, h100.mig_pending, h100.mig_devices) == (True, True, MIG_UUIDS)
    # no MIG support, ECC off and counters unsupported, memory query refused
    assert l4.mig_current is None and l4.mig_devices == ()
    assert l4.ecc_current is False and l4.ecc_volatile_uncorrected is None
    assert l4.memory_total is None and l4.memory_free is None
    assert l4.remapped_rows_uncorrectable is None
    assert l4.query_errors == ("memory: Insufficient Permissions",)
    assert a100.query_errors == ()  # "not supported" is a fact, not an error

    # direct NVLink: 12 up on GPU 0's side, 11 of 12 on GPU 1's (4-digit domain spelling)
    p01, p10 = inv.pair(0, 1), inv.pair(1, 0)
    assert p01 is not None and p10 is not None
    assert (p01.label, p01.via_nvswitch, p01.pcie) == ("NV12", False, LinkKind.PIX)
    assert p10.label == "NV12"
    labels = {(p.a, p.b): p.label for p in inv.pairs}
    assert labels[(0, 2)] == labels[(2, 1)] == "NODE"
    assert labels[(0, 3)] == labels[(3, 2)] == "SYS"
    assert len(inv.pairs) == 12  # every ordered pair
    p03 = inv.pair(0, 3)
    assert p03 is not None
    assert (p03.p2p_read, p03.p2p_write, p03.p2p_nvlink) == (
        P2PStatus.TOPOLOGY_NOT_SUPPORTED,
        P2PStatus.TOPOLOGY_NOT_SUPPORTED,
        P2PStatus.NOT_SUPPORTED,
    )
    assert P2PStatus.TOPOLOGY_NOT_SUPPORTED.short == "TNS"

    text = "\n".join(inv.warnings)
    assert "GPU 2 (NVIDIA H100 PCIe) has MIG mode on" in text
    assert "GPU 3 (NVIDIA L4): NVML memory: Insufficient Permissions" in text
    assert "no P2P read access between GPUs 0<->3 (topology-not-supported), 1<->3" in text


def test_health_warnings_for_ecc_and_remapping(install: object) -> None:
    fake = two_h200_nvswitch()
    fake.gpus[1].ecc_uncorrected = (3, 40)
    fake.gpus[1].remapped = (0, 2, 1, 1)
    install(fake)  # type: ignore[operator]
    inv = collect_inventory(environ=NO_ENV)
    g1 = inv.gpus[1]
    assert (g1.ecc_volatile_uncorrected, g1.ecc_aggregate_uncorrected) == (3, 40)
    assert (g1.remapped_rows_uncorrectable, g1.remap_pending, g1.remap_failure) == (2, True, True)
    text = "\n".join(inv.warnings)
    assert "3 uncorrectable ECC error(s) since the driver loaded" in text
    assert "row remapping failed" in text


def test_unopenable_gpu_is_left_out_with_a_warning(install: object) -> None:
    fake = four_mixed()
    fake.handle_errors = {1: GPU_IS_LOST}
    install(fake)  # type: ignore[operator]
    inv = collect_inventory(environ=PCI_ORDER)
    assert [g.index for g in inv.gpus] == [0, 2, 3]  # NVML indices keep their numbers
    assert any("GPU 1: NVML cannot open it (GPU is lost)" in w for w in inv.warnings)
    assert inv.pair(0, 2) is not None and inv.pair(0, 1) is None


@pytest.mark.parametrize(
    ("fake_kwargs", "expected"),
    [
        # edge: the usual no-GPU machine (library missing) and a machine with the driver unloaded
        ({"init_error": LIBRARY_NOT_FOUND}, "NVML could not start: NVML Shared Library Not Found"),
        ({"init_error": DRIVER_NOT_LOADED}, "NVML could not start: Driver Not Loaded"),
        # edge: init works, listing does not
        ({"count_error": DRIVER_NOT_LOADED}, "NVML failed while listing GPUs: Driver Not Loaded"),
    ],
)
def test_nvml_failure_gives_zero_gpus(install: object, fake_kwargs: dict[str, int], expected: str) -> None:
    fake = FakeNvml(two_h200_nvswitch().gpus, **fake_kwargs)
    install(fake)  # type: ignore[operator]
    inv = collect_inventory(environ=NO_ENV)
    assert inv.gpus == () and inv.pairs == () and inv.cuda_ordinals == ()
    assert inv.nvml_error == expected
    assert inv.python_version  # versions are still reported
    assert fake.initialized == 0


def test_pynvml_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    inv = collect_inventory(environ=NO_ENV)
    assert inv.gpus == ()
    assert inv.nvml_error is not None and "nvidia-ml-py" in inv.nvml_error


def test_real_pynvml_never_raises() -> None:
    # On CI (no driver) NVML fails to start; on a GPU machine it lists real GPUs.
    inv = collect_inventory(environ=NO_ENV)
    if inv.nvml_error is not None:
        assert inv.gpus == ()
    else:
        assert all(g.uuid.startswith("GPU-") for g in inv.gpus)
        assert inv.driver_version


# --- CUDA ordinals ------------------------------------------------------------------------


def test_fastest_first_default_differs_from_pci_order(install: object) -> None:
    inv = mixed(install)  # CUDA_DEVICE_ORDER unset: FASTEST_FIRST
    assert inv.device_order is DeviceOrder.FASTEST_FIRST
    # 9.0 first, then 8.9, then the two 8.0 in PCI order
    assert [o.nvml_index for o in inv.cuda_ordinals] == [2, 3, 0, 1]
    order_warnings = [w for w in inv.warnings if "device order differs" in w]
    assert len(order_warnings) == 1
    assert "cuda:0 is GPU 2" in order_warnings[0] and "FASTEST_FIRST" in order_warnings[0]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in order_warnings[0]


def test_pci_bus_id_order_matches_nvidia_smi(install: object) -> None:
    inv = mixed(install, PCI_ORDER)
    assert [o.nvml_index for o in inv.cuda_ordinals] == [0, 1, 2, 3]
    assert [o.uuid for o in inv.cuda_ordinals] == list(MIXED_UUIDS)
    assert not any("device order" in w for w in inv.warnings)


def test_invalid_device_order_falls_back(install: object) -> None:
    inv = mixed(install, {"CUDA_DEVICE_ORDER": "pci"})
    assert inv.device_order is DeviceOrder.FASTEST_FIRST and inv.cuda_device_order == "pci"
    assert any("CUDA_DEVICE_ORDER='pci' is not" in w for w in inv.warnings)


U0, U1, U2, U3 = MIXED_UUIDS

# (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, expected NVML indices, expected MIG flags or None,
#  a warning fragment or None for "no warning about CUDA_VISIBLE_DEVICES or order")
VISIBLE_CASES = [
    # plain subset in PCI order: no surprise, no warning
    ("2,3", "PCI_BUS_ID", [2, 3], None, None),
    # reversed list: cuda:0 is GPU 1
    ("1,0", "PCI_BUS_ID", [1, 0], None, "lists them in another order"),
    # integers count in CUDA's FASTEST_FIRST order (2, 3, 0, 1), not nvidia-smi's
    ("0,1", "FASTEST_FIRST", [2, 3], None, "counts in CUDA's FASTEST_FIRST order"),
    ("0,1", "", [2, 3], None, "counts in CUDA's FASTEST_FIRST order"),
    # an index past the last GPU ends the list there
    ("0,7,1", "PCI_BUS_ID", [0], None, "there is no CUDA device 7"),
    # a negative entry ends the list; -1 alone hides every GPU
    ("0,-1,1", "PCI_BUS_ID", [0], None, "CUDA stops reading at '-1'"),
    ("-1", "PCI_BUS_ID", [], None, "it hides every GPU"),
    ("", "PCI_BUS_ID", [], None, "it hides every GPU"),
    # a repeated entry empties the list (CUDA and torch agree)
    ("0,0", "PCI_BUS_ID", [], None, "repeated"),
    ("1,+1", "PCI_BUS_ID", [], None, "repeated"),
    # strtoul reading: "1gpu2" is 1
    ("1gpu2,2ampere", "PCI_BUS_ID", [1, 2], None, None),
    # garbage first: nothing
    ("one,two", "PCI_BUS_ID", [], None, "names no GPU"),
    # UUIDs, full or a unique prefix, in the order given; order variable irrelevant
    (f"{U3[:12]},{U0}", "FASTEST_FIRST", [3, 0], None, "lists them in another order"),
    (f"{U0},{U2}", "FASTEST_FIRST", [0, 2], None, None),
    # an unknown or ambiguous UUID ends the list
    (f"{U1},GPU-ffff", "PCI_BUS_ID", [1], None, "'GPU-ffff' matches no GPU"),
    ("GPU-0", "PCI_BUS_ID", [], None, "matches no GPU, or several"),
    # the same GPU twice through two prefixes
    (f"{U1[:10]},{U1}", "PCI_BUS_ID", [], None, "names a device already listed"),
    # a UUID list ends at the first entry without the prefix
    (f"{U1},0", "PCI_BUS_ID", [1], None, "CUDA stops reading at '0'"),
    # MIG instances map to their parent GPU
    (f"{MIG_UUIDS[1]}", "PCI_BUS_ID", [2], [True], None),
]


@pytest.mark.parametrize(("visible", "order", "indices", "mig", "warning"), VISIBLE_CASES)
def test_cuda_visible_devices_mapping(
    install: object, visible: str, order: str, indices: list[int], mig: list[bool] | None, warning: str | None
) -> None:
    environ = {"CUDA_VISIBLE_DEVICES": visible}
    if order:
        environ["CUDA_DEVICE_ORDER"] = order
    inv = mixed(install, environ)
    assert [o.nvml_index for o in inv.cuda_ordinals] == indices
    assert [o.ordinal for o in inv.cuda_ordinals] == list(range(len(indices)))
    if mig is not None:
        assert [o.mig for o in inv.cuda_ordinals] == mig
        assert inv.cuda_ordinals[0].uuid == MIG_UUIDS[1]
    relevant = [w for w in inv.warnings if "CUDA_VISIBLE_DEVICES" in w or "device order" in w]
    if warning is None:
        assert relevant == []
    else:
        assert any(warning in w for w in relevant), relevant


# Cross-checked against torch's own tests of torch.cuda._parse_visible_devices.
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1gpu2,2ampere", [1, 2]),  # rest of an entry is ignored
        ("0, 1, 2, -1, 3", [0, 1, 2]),  # negatives abort parsing
        ("0, 1, 2, 1", []),  # a repeated ordinal empties the set
        ("2, +3, -0, 5", [2, 3, 0, 5]),  # unary plus and minus
        ("one,two,3,4", []),  # garbage first: empty
        ("4,3,two,one", [4, 3]),  # garbage ends the list
        ("GPU-9e8d35e3", ["GPU-9e8d35e3"]),
        ("GPU-123, 2", ["GPU-123"]),
        ("MIG-89c850dc-d0d6-4a98-8fc8-59c6a8e1a1a1,GPU-1", ["MIG-89c850dc-d0d6-4a98-8fc8-59c6a8e1a1a1"]),
        ("GPU-a,GPU-a", []),
    ],
)
def test_parse_visible_devices(text: str, expected: list[int] | list[str]) -> None:
    assert parse_visible_devices(text) == expected


def test_map_cuda_ordinals_without_gpus() -> None:
    assert map_cuda_ordinals([], visible=None, order=DeviceOrder.FASTEST_FIRST) == ((), ())
    ordinals, warnings = map_cuda_ordinals([], visible="0", order=DeviceOrder.PCI_BUS_ID)
    assert ordinals == () and "there is no CUDA device 0" in warnings[0]


# --- selection and probe children -------------------------------------------------------------


def test_select_gpus_all_and_order(install: object) -> None:
    inv = mixed(install)
    assert select_gpus(inv, None) == inv.gpus
    assert select_gpus(inv, "all") == inv.gpus
    assert select_gpus(inv, " ALL ") == inv.gpus
    assert [g.index for g in select_gpus(inv, "3,0")] == [3, 0]  # --gpus order is kept
    assert [g.index for g in select_gpus(inv, " 1 , 2 ")] == [1, 2]


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        # unknown index: the message lists what exists, with names and bus ids
        (
            "5",
            [
                "no GPU 5",
                "This machine has 4",
                "GPU 0 (NVIDIA A100-SXM4-80GB, 00000000:07:00.0)",
                "GPU 3 (NVIDIA L4",
            ],
        ),
        ("0,4,9", ["no GPU 4, 9"]),
        ("1,1", ["names GPU 1 twice"]),
        ("0,,1", ["malformed"]),
        ("", ["malformed"]),
        ("0,", ["malformed"]),
        ("cuda:0", ["'cuda:0' is not a GPU index", "nvidia-smi"]),
        ("-1", ["'-1' is not a GPU index"]),
        (U0, ["is not a GPU index"]),
    ],
)
def test_select_gpus_errors(install: object, spec: str, fragments: list[str]) -> None:
    inv = mixed(install)
    with pytest.raises(GpuSelectionError) as info:
        select_gpus(inv, spec)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_select_gpus_on_a_machine_without_gpus() -> None:
    inv = Inventory(nvml_error="NVML could not start: Driver Not Loaded")
    assert select_gpus(inv, None) == ()
    with pytest.raises(GpuSelectionError, match="no GPU that NVML can see.*Driver Not Loaded"):
        select_gpus(inv, "0")


def test_child_env_pins_selected_gpus_by_uuid(install: object) -> None:
    inv = mixed(install)  # FASTEST_FIRST would shuffle indices; UUIDs cannot be shuffled
    chosen = select_gpus(inv, "3,1")
    assert child_cuda_env(chosen) == {"CUDA_VISIBLE_DEVICES": f"{U3},{U1}", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert probe_ordinal(chosen, 3) == 0 and probe_ordinal(chosen, 1) == 1
    with pytest.raises(GpuSelectionError):
        probe_ordinal(chosen, 0)
    assert describe_probe_mapping(select_gpus(inv, "0,3")) == (
        "GPU 0 (NVML) -> cuda:0 in probes",
        "GPU 3 (NVML) -> cuda:1 in probes",
    )
    # the CPU tier: no GPU visible
    assert child_cuda_env(())["CUDA_VISIBLE_DEVICES"] == ""


def test_subset_inventory_keeps_pairs_among_selected(install: object) -> None:
    inv = mixed(install)
    sub = subset_inventory(inv, select_gpus(inv, "0,3"))
    assert [g.index for g in sub.gpus] == [0, 3]
    assert {(p.a, p.b) for p in sub.pairs} == {(0, 3), (3, 0)}


# --- JSON -----------------------------------------------------------------------------------


@pytest.mark.parametrize("machine", [two_h200_nvswitch, four_mixed])
def test_inventory_json_round_trip(install: object, machine: object) -> None:
    install(machine())  # type: ignore[operator]
    inv = collect_inventory(environ={"CUDA_VISIBLE_DEVICES": "1,0"})
    assert from_jsonable(Inventory, json.loads(to_json(inv))) == inv
    # through the versioned --json document too (its "kind" key is ignored on the way back)
    doc = json.loads(json.dumps(json_document("inventory", inv)))
    assert doc["kind"] == "inventory"
    assert from_jsonable(Inventory, doc) == inv


def test_zero_gpu_inventory_round_trip() -> None:
    inv = Inventory(nvml_error="NVML could not start: NVML Shared Library Not Found", python_version="3.11")
    assert from_jsonable(Inventory, json.loads(to_json(inv))) == inv


# --- the env command ---------------------------------------------------------------------------

runner = CliRunner(env={"COLUMNS": "220", "NO_COLOR": "1"})


@pytest.mark.usefixtures("clean_cuda_env")
def test_env_command_renders_the_machine(install: object) -> None:
    install(four_mixed())  # type: ignore[operator]
    result = runner.invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for fragment in (
        "driver 580.95.05",
        "CUDA (driver) 13.0",
        "NVIDIA H100 PCIe",
        "00000000:87:00.0",
        "NV12",  # link grid
        "SYS",
        "OK/OK/OK",  # P2P grid, GPU 0 -> 1
        "TNS/TNS/NS",  # P2P grid, GPU 0 -> 3
        "cuda:0 -> GPU 2 (NVML)",  # FASTEST_FIRST mapping
        "warning: CUDA's device order differs",
        "has MIG mode on",
    ):
        assert fragment in out, fragment


@pytest.mark.usefixtures("clean_cuda_env")
def test_env_command_gpus_shows_probe_mapping(install: object) -> None:
    install(four_mixed())  # type: ignore[operator]
    result = runner.invoke(app, ["env", "--gpus", "3,0"])
    assert result.exit_code == 0, result.output
    assert "GPU 3 (NVML) -> cuda:0 in probes" in result.stdout
    assert "GPU 0 (NVML) -> cuda:1 in probes" in result.stdout
    assert "NVIDIA H100" not in result.stdout  # GPU 2 not selected


@pytest.mark.usefixtures("clean_cuda_env")
def test_env_command_json(install: object) -> None:
    install(two_h200_nvswitch())  # type: ignore[operator]
    result = runner.invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "inventory" and doc["schema_version"] == 1
    inv = from_jsonable(Inventory, doc)
    assert [g.uuid for g in inv.gpus] == list(H200_UUIDS)
    assert inv.pair(0, 1) is not None and inv.pair(0, 1).label == "NV18"  # type: ignore[union-attr]

    result = runner.invoke(app, ["env", "--json", "--gpus", "1"])
    assert result.exit_code == 0
    assert [g["index"] for g in json.loads(result.stdout)["gpus"]] == [1]


@pytest.mark.usefixtures("clean_cuda_env")
def test_env_command_bad_gpus_is_a_usage_error(install: object) -> None:
    install(two_h200_nvswitch())  # type: ignore[operator]
    result = runner.invoke(app, ["env", "--gpus", "2"])
    assert result.exit_code == ExitCode.USAGE
    assert result.stdout == ""
    assert "no GPU 2" in result.stderr and "GPU 1 (NVIDIA H200, 00000000:2A:00.0)" in result.stderr


@pytest.mark.usefixtures("clean_cuda_env")
@pytest.mark.parametrize("args", [["env"], ["env", "--json"]])
def test_env_command_without_nvml_exits_0(install: object, args: list[str]) -> None:
    install(FakeNvml([], init_error=LIBRARY_NOT_FOUND))  # type: ignore[operator]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    if "--json" in args:
        doc = json.loads(result.stdout)
        assert doc["gpus"] == [] and "NVML Shared Library Not Found" in doc["nvml_error"]
    else:
        assert "No NVIDIA GPU found: NVML could not start: NVML Shared Library Not Found" in result.stdout


@pytest.mark.usefixtures("clean_cuda_env")
def test_env_command_with_real_pynvml() -> None:
    # No fake: on CI NVML cannot start and env still exits 0.
    result = runner.invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    assert "Python" in result.stdout
