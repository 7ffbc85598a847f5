"""The catalogue of causes: stable kebab-case ids with fixed parts (message, mechanism, fix).

Ids and public evidence follow ``shared/FINDINGS.md``. A ``Diagnosis`` names a cause by id and
holds the facts of one run; everything fixed about a cause lives here. Each cause has a docs
page at ``docs/causes/<id>.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The project's home and its docs, as pyproject.toml's [project.urls] give them (a test checks
#: they agree): reports that leave the terminal (SARIF's helpUri) link a cause's page here.
PROJECT_URL = "https://github.com/qmoe-doctor/qmoe-doctor"
DOCS_URL = PROJECT_URL + "/blob/main/docs/"


@dataclass(frozen=True, slots=True, kw_only=True)
class Cause:
    id: str
    title: str
    mechanism: str  # two sentences: what goes wrong and why
    fix: str  # a code snippet
    public_evidence: tuple[str, ...]  # public reports of it

    @property
    def docs(self) -> str:
        return f"docs/causes/{self.id}.md"


_CAUSES = (
    Cause(
        id="missing-device-guard",
        title="Kernel launched on the current device instead of its tensors' device",
        mechanism=(
            "Triton launches on the *current* CUDA device and that device's current stream, not on "
            "the device that holds the tensors. With the operands on another GPU the launch fails "
            "the pointer check, or, once peer access is on, runs remotely over NVLink/PCIe, several "
            "times slower and unordered against the producer's stream."
        ),
        fix=(
            "def moe_grouped_gemm(x, w, m_sizes):\n"
            "    with torch.cuda.device(x.device):  # launch where the tensors live\n"
            "        kernel[grid](x, w, y, m_sizes, ...)"
        ),
        public_evidence=(
            "triton #2925",
            "Liger-Kernel #1303/#1304",
            "AutoAWQ #341",
            "vLLM #1959",
            "transformers-qwen3-moe-fused #1",
        ),
    ),
    Cause(
        id="cross-device-stream-race",
        title="Kernel unordered against the stream that produces its inputs",
        mechanism=(
            "The kernel runs on a stream that never waits for the stream still writing its inputs "
            "(another device's stream, or the wrong stream of the same device). It reads stale "
            "memory: garbage or NaN, or an illegal access when the stale value is a size or index."
        ),
        fix=(
            "with torch.cuda.device(x.device):\n"
            "    stream = torch.cuda.current_stream(x.device)\n"
            "    # or, when a side stream is required: side.wait_stream(stream)\n"
            "    kernel[grid](...)"
        ),
        public_evidence=("unsloth #6831/#6912", "flash-attention #1793"),
    ),
    Cause(
        id="int32-offset-overflow",
        title="Index x stride product formed in int32 passes 2**31 elements",
        mechanism=(
            "An offset such as expert_idx * stride_we or row * stride_xm is formed in int32 and "
            "wraps once it passes 2**31 - 1 elements. The wrapped pointer usually lands inside the "
            "same allocation, so the result is silently wrong; TRITON_DEBUG=1 turns it into a "
            "device-side assert naming the source line."
        ),
        fix=(
            "# cast the index where the product is formed, not every stride:\n"
            "w_base = w_ptr + expert_idx.to(tl.int64) * stride_we"
        ),
        public_evidence=("vLLM #5938/#34507", "Liger-Kernel #1296/#1248", "axolotl #3865"),
    ),
    Cause(
        id="invalid-routing",
        title="Kernel trusts m_sizes / expert ids that do not describe its rows",
        mechanism=(
            "The kernel walks rows by the counts in m_sizes (or indexes weights by expert ids) "
            "without masking by M or E. When the routing sums past M, holds out-of-range or -1 "
            "ids, or global ids reach a local weight stack, it reads and writes outside x and y; "
            "the caching allocator hides many such writes."
        ),
        fix=(
            "rows = row_start + tl.arange(0, BLOCK_M)\n"
            "row_mask = (rows < row_start + m_size) & (rows < M)  # never trust m_sizes alone\n"
            "# and at the routing step, once, off the hot path:\n"
            "assert int(m_sizes.sum()) == x.shape[0]"
        ),
        public_evidence=("vLLM #34270/#46408", "vllm-gaudi #1796"),
    ),
    Cause(
        id="default-device-buffer",
        title="Helper or output buffer allocated on the current device",
        mechanism=(
            'A buffer made with device="cuda" (or torch.empty(...).cuda()) lands on the current '
            "device, not the input's. The kernel then mixes pointers from two GPUs: a device "
            "mismatch error, a pointer-check failure, or remote traffic."
        ),
        fix=("offsets = torch.empty(E + 1, dtype=torch.int32, device=x.device)  # not device='cuda'"),
        public_evidence=("mamba #103", "TileKernels #28", "apex #319"),
    ),
    Cause(
        id="device-never-set",
        title="A rank never set its device",
        mechanism=(
            "A process that never calls torch.cuda.set_device runs every unguarded launch and "
            "every device='cuda' allocation on GPU 0. Ranks then share one GPU or mix devices."
        ),
        fix='torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # first thing in every rank',
        public_evidence=("torchtitan #1225",),
    ),
    Cause(
        id="device-order-mismatch",
        title="CUDA and NVML/nvidia-smi number the GPUs differently",
        mechanism=(
            "CUDA's default FASTEST_FIRST order and CUDA_VISIBLE_DEVICES remaps differ from "
            "nvidia-smi's PCI order, so 'GPU 1' is not the same GPU to every tool."
        ),
        fix="export CUDA_DEVICE_ORDER=PCI_BUS_ID  # and map GPUs by UUID, never by index",
        public_evidence=("gpustack #1633",),
    ),
    Cause(
        id="wrong-device-stream",
        title="Launch on a stream other than the caller's current stream of the tensors' device",
        mechanism=(
            "The wrapper launches on a stream it picked itself: current_stream() without a device "
            "index, the null/default stream, or a stream cached from another device. The caller's "
            "producer on its current stream is not ordered before the kernel, so it reads stale "
            "inputs."
        ),
        fix=(
            "with torch.cuda.device(x.device):\n"
            "    # launch on the caller's current stream of x.device (Triton does this by default);\n"
            "    # never torch.cuda.default_stream() or a stream taken before the guard\n"
            "    kernel[grid](...)\n"
            "# a stream of your own: s.wait_stream(torch.cuda.current_stream(x.device)) before it,\n"
            "# torch.cuda.current_stream(x.device).wait_stream(s) after, x.record_stream(s)"
        ),
        public_evidence=("flash-attention #2356", "flashinfer #349/#361"),
    ),
    Cause(
        id="autotune-inplace-rerun",
        title="Autotuner re-runs an in-place or accumulating kernel",
        mechanism=(
            "On the first call for a key, @triton.autotune benchmarks every config by running the "
            "kernel many times on the caller's buffers. A kernel that accumulates into or "
            "overwrites an input is applied many times, so the first call per process is wrong."
        ),
        fix=(
            '@triton.autotune(configs=..., key=[...], restore_value=["y_ptr"])  # or reset_to_zero\n'
            "# or pin one config per shape from a table instead of autotuning at run time"
        ),
        public_evidence=("triton #6547", "triton #4217"),
    ),
    Cause(
        id="per-device-state-cached",
        title="Per-device properties cached from the first device",
        mechanism=(
            "SM count, shared-memory limit or a loaded module is cached from the first device and "
            "reused on another, sizing grids and tiles for the wrong GPU."
        ),
        fix="@functools.cache\ndef num_sms(device_index: int) -> int: ...  # keyed by device",
        public_evidence=("bitsandbytes #1952", "flashinfer #4260"),
    ),
    Cause(
        id="launch-config-fault",
        title="Launch config the device cannot run",
        mechanism=(
            "A tile/stage/warp config needs more shared memory or registers than a block may have "
            "on this device, or the grid is sized from another device. Triton raises "
            "OutOfResources at launch; a wrongly sized grid skips or repeats tiles."
        ),
        fix=(
            "# prune configs against the device's limits before launching:\n"
            "smem = (BLOCK_M + BLOCK_N) * BLOCK_K * itemsize * num_stages\n"
            "assert smem <= torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin"
        ),
        public_evidence=("Liger-Kernel #1246",),
    ),
    Cause(
        id="misaligned-operand",
        title="Kernel assumes 16-byte-aligned operands and faults on a sliced view",
        mechanism=(
            "TMA descriptors and vectorized loads need 16-byte-aligned base pointers and strides. "
            "A kernel that accepts a view sliced off an element boundary (a storage offset, a "
            "row stride of K + 1) without checking faults with `CUDA error: misaligned address` "
            "(an illegal instruction for some TMA copies), or reads shifted data."
        ),
        fix=(
            "# where the descriptor is made: TMA needs a 16-byte-aligned base and strides\n"
            "def tma_ready(t):\n"
            "    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])\n"
            "if not tma_ready(x):  # a sliced view: copy it into a fresh, aligned buffer\n"
            "    x = x.clone(memory_format=torch.contiguous_format)  # .contiguous() keeps the offset\n"
            'assert tma_ready(x), "the TMA path needs K * itemsize % 16 == 0"'
        ),
        public_evidence=("triton #10927/#10931", "triton #7385", "FlagGems #2489/#4471"),
    ),
    Cause(
        id="p2p-path-broken",
        title="The peer-to-peer path corrupts copies",
        mechanism=(
            "The hardware, driver or IOMMU path between two GPUs corrupts peer copies, so even "
            "a.to(1).to(0) != a. No kernel change fixes it."
        ),
        fix="# export NCCL_P2P_DISABLE=1 and stage copies through the host; report to the admin",
        public_evidence=("pytorch #84803",),
    ),
    Cause(
        id="expandable-segments-unmap",
        title="empty_cache() with another device current unmaps memory in use",
        mechanism=(
            "With expandable segments, torch.cuda.empty_cache() called while another device is "
            "current can unmap pages still in use by a kernel on the first device."
        ),
        fix="with torch.cuda.device(x.device):\n    torch.cuda.empty_cache()",
        public_evidence=("pytorch #196258",),
    ),
    Cause(
        id="thread-without-context",
        title="First launch from a thread with no current CUDA context",
        mechanism=(
            "A new thread has no current CUDA context; Triton < 3.2 launched into none and failed "
            "with an invalid context or handle error."
        ),
        fix="torch.cuda.set_device(x.device)  # at the start of every worker thread",
        public_evidence=("triton #3729", "triton #5276"),
    ),
)

CAUSES: dict[str, Cause] = {c.id: c for c in _CAUSES}


def get_cause(cause_id: str) -> Cause:
    try:
        return CAUSES[cause_id]
    except KeyError:
        raise KeyError(f"unknown cause id {cause_id!r}; known: {', '.join(CAUSES)}") from None
