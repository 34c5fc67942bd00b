"""Which device we run on (``tpu``: TorchTPU, ``xla``: PyTorch/XLA, ``cuda``, ``cpu``), its three modes, and each
backend's policy. Only this module calls ``torch_tpu``, and ``torch_xla`` is imported only for ``xla``: importing
either without its hardware can hang or abort the process (``docs/torch_tpu.md``)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import pathlib
import re
import tempfile
import time
import warnings
from typing import Callable

import torch
import torch._inductor.config as inductor_config

from .chips import tpu_scan

BACKENDS = ("tpu", "xla", "cuda", "cpu")
MODES = ("eager", "defer_and_fuse", "compile")
ENV_VAR = "HELPERS_BACKEND"
_DEFER_AND_FUSE_BACKENDS = ("tpu", "xla")
_COMPILE_BACKEND = {"tpu": "tpu", "xla": "openxla", "cuda": "inductor", "cpu": "inductor"}
V5E_BYTES_PER_S = 819e9  # Google's published HBM bandwidth of one TPU v5e chip
# HBM a v5e-1 reports to programs ("total_hbm_limit_gb=15.75GiB" to vLLM TPU: xbill9/gemma4-dev,
# jev-tpu-v5e1/evidence-v5e1/kv-and-memory.txt; Google says "16 GB"). A device at hand reports its own.
V5E_HBM_BYTES = int(15.75 * 2**30)
AUDIT_VAR = "HELPERS_XLA_AUDIT"  # set (to 1) before the xla backend starts: XLA dumps what it compiles
DUMP_FLAGS = "--xla_dump_to={} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*"
GENERATION_TOKENS = 32  # tokens per run in the series (``Backend.generation_length``)
TIMED_TOKENS = 128  # tokens per timed decode run, as gpt-fast times (``Backend.timed_length``)


class BackendError(RuntimeError):
    """A backend or mode that this machine cannot give; the message says what to do."""


def _tpu_present() -> bool:
    # TorchTPU renames PrivateUse1 to "tpu" only with a TPU there; torch.tpu.is_available() raises on torch >= 2.11
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and accelerator.type == "tpu"


def _xla_asked() -> bool:
    # PJRT_DEVICE tells PyTorch/XLA which client to make: setting it is asking for XLA
    return "PJRT_DEVICE" in os.environ and importlib.util.find_spec("torch_xla") is not None


def detect() -> str:
    """The backend here: tpu, then xla (if PJRT_DEVICE is set), cuda, cpu."""
    if _tpu_present():
        return "tpu"
    if _xla_asked():
        return "xla"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_available(name: str) -> None:
    if name == "tpu" and not _tpu_present():
        raise BackendError(
            "backend 'tpu' asked for, but no TPU is visible to TorchTPU: in Colab pick "
            "Runtime > Change runtime type > v5e-1 TPU and rerun the install cell, or use "
            f"{ENV_VAR}=cpu."
        )
    if name == "xla" and importlib.util.find_spec("torch_xla") is None:
        raise BackendError(
            "backend 'xla' asked for, but torch_xla is not installed: "
            "pip install torch==2.9.0 torch_xla==2.9.0 (and PJRT_DEVICE=CPU without a TPU)."
        )
    if name == "cuda" and not torch.cuda.is_available():
        raise BackendError(f"backend 'cuda' asked for, but torch sees no CUDA GPU: use {ENV_VAR}=cpu.")


def dump_folder() -> pathlib.Path | None:
    """Where XLA dumps what it compiles in this process, if ``XLA_FLAGS`` says so."""
    found = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return pathlib.Path(found.group(1)) if found else None


def enable_dump() -> pathlib.Path:
    """Set (or reuse) a folder in ``XLA_FLAGS`` for XLA's dumps: before the xla backend's first device use, as XLA reads
    its flags once."""
    if dump_folder():
        return dump_folder()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="xla-dump-"))
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DUMP_FLAGS.format(folder)}".strip()
    return folder


def _set_tpu_eager_mode(eager) -> None:
    """TorchTPU's eager mode for the process, set once where the backend is made (strict eager, ``DEFER_NEVER``: an
    eager op compiles once per shape, where a deferred one compiles per scalar value too; in 0.2.0's wheel only strict
    eager donates an in-place op's buffer). 0.2.0 sets it through its module's ``eager_mode`` property (its
    ``set_eager_mode`` is a scope); an earlier wheel's ``set_eager_mode``, beside ``get_eager_mode``, sets it."""
    if hasattr(torch.tpu, "get_eager_mode"):
        torch.tpu.set_eager_mode(eager)
    else:
        torch.tpu.eager_mode = eager


@contextlib.contextmanager
def _tpu_eager_mode(eager):
    """TorchTPU's eager mode for a block: 0.2.0's ``set_eager_mode`` is a context manager; an earlier wheel's sets the
    mode at once and returns nothing (``get_eager_mode`` reads it back), so that one is set and restored here."""
    previous = torch.tpu.get_eager_mode() if hasattr(torch.tpu, "get_eager_mode") else None
    scoped = torch.tpu.set_eager_mode(eager)
    if hasattr(scoped, "__enter__"):
        with scoped:
            yield
        return
    from importlib.metadata import version

    warnings.warn(
        f"torch_tpu {version('torch_tpu')}: set_eager_mode is a setter there, not 0.2.0's context manager; the "
        f"course sets the mode and puts back {previous} after the block (pin torch_tpu==0.2.0 to match it)",
        stacklevel=3,
    )
    try:
        yield
    finally:
        if previous is not None:
            torch.tpu.set_eager_mode(previous)


@dataclasses.dataclass
class CompileCount:
    """What a ``with backend.compile_counter() as c:`` block compiled: dynamo ``graphs``, device ``programs`` and their
    ``executions`` (None where uncounted: cpu, cuda), and its ``seconds``, synced at both ends."""

    graphs: int = 0
    programs: int | None = None
    executions: int | None = None
    seconds: float = 0.0


class Backend:
    """One backend (``get_backend`` checks it is available): device, modes, policy, sync, memory, compile counts."""

    def __init__(self, name: str):
        self.name = name
        if name == "xla":
            os.environ.setdefault("PJRT_DEVICE", "CPU")
            if os.environ.get(AUDIT_VAR):  # before the client starts: XLA reads its flags once
                enable_dump()
            self._xla = importlib.import_module("torch_xla")
            self._xm = importlib.import_module("torch_xla.core.xla_model")
            self._met = importlib.import_module("torch_xla.debug.metrics")
            self.device = self._xla.device()
            # the CPU client's sync waits: torch_xla 2.9 crashed (SIGSEGV, SIGABRT) reading while an async sync ran
            self._sync_waits = os.environ["PJRT_DEVICE"] == "CPU"
        else:
            if name == "tpu":  # before any op
                _set_tpu_eager_mode(torch.tpu.EagerMode.DEFER_NEVER)
            self.device = torch.device(name)
        if name == "cpu":
            # process-wide: kernels read the thread count when they run, so one compile cache serves one thread
            # (a test worker) and the machine's default (a reader)
            inductor_config.cpp.dynamic_threads = True

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, device={self.device})"

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.defers_ops else ("eager", "compile")

    # --- policy: what the rest of the course asks of a backend, decided here only ----------
    @property
    def defers_ops(self) -> bool:
        """Ops can be deferred and fused (tpu, xla): a graph that changes shape each step is a compile each step."""
        return self.name in _DEFER_AND_FUSE_BACKENDS

    @property
    def lazy(self) -> bool:
        """PyTorch/XLA's lazy tensors: ops run as one program when synced; on its CPU client each new program takes
        seconds to minutes to compile."""
        return self.name == "xla"

    @property
    def on_tpu(self) -> bool:
        """Programs run on a TPU chip: TorchTPU, or PyTorch/XLA with ``PJRT_DEVICE=TPU``."""
        return self.name == "tpu" or (self.lazy and os.environ.get("PJRT_DEVICE") == "TPU")

    @property
    def load_device_map(self) -> dict[str, str]:
        """``from_pretrained``'s ``device_map``: transformers places nothing on a TPU by itself; accelerate cannot place
        onto XLA devices, so there ``place`` moves the model."""
        return {"": "cpu"} if self.lazy else {"": str(self.device)}

    def place(self, model):
        """A model loaded with ``load_device_map``, on the device (on xla moved, then tied again: the move makes new
        tensors)."""
        if self.lazy:
            model.to(self.device)
            model.tie_weights()
        return model

    @property
    def generation_length(self) -> int:
        """Tokens per run in the series; 8 on xla, where HF ``generate`` compiles a new program every step."""
        return 8 if self.lazy else GENERATION_TOKENS

    @property
    def timed_length(self) -> int:
        """Tokens per timed run (32 on the twin are mostly noise); on xla as many as generated: timings there time the
        CPU client."""
        return self.generation_length if self.lazy else TIMED_TOKENS

    @property
    def runs_compiled_generate(self) -> bool:
        """Whether HF ``generate`` may use a compiled forward: not on xla, where torch_xla 2.9 crashed at its stop check
        (SIGSEGV or SIGABRT, twice of two)."""
        return not self.lazy

    @property
    def xla_dump_folder(self):
        """Where XLA dumps its programs: on xla started with ``HELPERS_XLA_AUDIT=1``."""
        return dump_folder() if self.lazy else None

    def sync(self) -> None:
        """Wait for every queued device op. On a TPU ``torch.accelerator.synchronize`` launches deferred ops
        (``MaterializeAll``) and waits for each stream (read in TorchTPU's sources, not run)."""
        if self.name == "xla":
            self._xm.wait_device_ops()
        elif self.name in ("tpu", "cuda"):
            torch.accelerator.synchronize()

    def memory(self) -> dict[str, int] | None:
        """``{"in_use", "peak", "total"}`` bytes from the backend's own counters (None on cpu); a TPU's total from
        TorchTPU's table by chip kind, failing that ``V5E_HBM_BYTES``."""
        if self.name in ("tpu", "cuda"):
            used = {"in_use": torch.accelerator.memory_allocated(), "peak": torch.accelerator.max_memory_allocated()}
            if self.name == "cuda":
                return used | {"total": torch.cuda.get_device_properties(self.device).total_memory}
            try:
                return used | {"total": torch.tpu.get_device_properties(self.device).total_memory}
            except (AttributeError, RuntimeError):
                return used | {"total": V5E_HBM_BYTES}
        if self.name == "xla":
            info = self._xla_memory_info()
            if not info:
                return None
            peak = info.get("peak_bytes_used", info["bytes_used"])
            return {"in_use": info["bytes_used"], "peak": peak, "total": info.get("bytes_limit")}
        return None

    def _xla_memory_info(self) -> dict | None:
        try:
            return self._xm.get_memory_info(self.device)
        except RuntimeError:  # the CPU client has no allocator stats ("GetAllocatorStats is not supported")
            return None

    def empty_cache(self) -> None:
        if self.name in ("tpu", "cuda"):
            torch.accelerator.empty_cache()

    def reset_peak_memory(self) -> None:
        if self.name in ("tpu", "cuda"):
            torch.accelerator.reset_peak_memory_stats()

    def _check_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise BackendError(f"unknown mode {mode!r}: pick one of {', '.join(MODES)}.")
        if mode not in self.modes:
            raise BackendError(
                f"mode {mode!r} is not offered by backend {self.name!r}: only "
                f"{' and '.join(_DEFER_AND_FUSE_BACKENDS)} defer and fuse ops "
                f"(set {ENV_VAR}=xla with torch_xla installed, or run on a TPU)."
            )

    @contextlib.contextmanager
    def mode(self, mode: str):
        """Run the block in ``eager`` or ``defer_and_fuse`` mode (``compile`` needs no scope)."""
        self._check_mode(mode)
        if self.name == "tpu" and mode != "compile":
            eager = torch.tpu.EagerMode.DEFER_AND_FUSE if mode == "defer_and_fuse" else torch.tpu.EagerMode.DEFER_NEVER
            with _tpu_eager_mode(eager):
                yield
        elif self.name == "xla":
            was_eager = self._xla.experimental.is_eager_mode()
            self._xla.experimental.eager_mode(mode == "eager")
            try:
                yield
            finally:
                self._xla.experimental.eager_mode(was_eager)
        else:
            yield

    def flush(self) -> None:
        """End a deferred group: lazy XLA runs nothing until told; TorchTPU defers until a read."""
        if self.name == "xla":
            self._xla.sync(wait=self._sync_waits)

    def compile(self, fn: Callable, **options) -> Callable:
        """``torch.compile`` with this backend's compiler, ``dynamic=False`` unless told: TorchTPU accepts only that,
        and each new shape is a new compile."""
        options.setdefault("dynamic", False)
        return torch.compile(fn, backend=_COMPILE_BACKEND[self.name], **options)

    def donate(self, *tensors: torch.Tensor) -> None:
        """Inside a compiled function: ``tensors`` written in place (a KV cache) lend their buffers to its outputs.
        PyTorch/XLA aliases only inputs marked so, else it copies them every call (``helpers.course.audits``);
        TorchTPU 0.2.0 has no such mark (its sources: mutated inputs come back as new buffers); inductor writes in
        place by itself."""
        if self.name == "xla":
            for tensor in tensors:
                torch.ops.xla.dynamo_set_buffer_donor_(tensor, True)

    def set_float32_matmuls_exact(self) -> None:
        """On a TPU, float32 matmuls run as bf16 passes unless told: set torch's (process-wide) precision to "highest"
        so the float32 twin's comparisons hold."""
        if self.name == "tpu":
            torch.set_float32_matmul_precision("highest")

    @property
    def int4_kernel(self) -> str | None:
        """Which of torch's weight kernels multiply 4-bit linears here, reading 4 bits a weight in one pass: "cpu" (x86
        AVX2 and AVX-512), "cuda" on sm80 and later (its kernel needs tensor-core instructions a T4's sm75 lacks: there,
        dequantized); None on tpu and xla, which have no such kernel: XLA is handed the codes (``QLinear``)."""
        if self.name == "cuda":
            return "cuda" if torch.cuda.get_device_capability(self.device) >= (8, 0) else None
        return "cpu" if self.name == "cpu" else None

    def use_matvec_loops(self) -> dict | None:
        """On a CPU, ``compile`` options that make one-row matmuls inductor's own loops (``decompose_mm_pass``),
        dequantizing in the same kernel: MKL reads short rows at under half a plain read's bandwidth, these loops at
        two to three times MKL's rate (``benchmarks/matvec.py``). Sets the pass's size limit process-wide. None
        elsewhere."""
        if self.name != "cpu":
            return None
        from torch._inductor.fx_passes import decompose_mem_bound_mm

        # read once, at the pass's import: its default (2048 rows) leaves the vocabulary-wide head to MKL
        decompose_mem_bound_mm.cpu_max_other_dimension_decomposition = 2**31
        # emulate_precision_casts: dequantized weights rounded to bf16 in the loop (measured: logits 0.36 off without)
        return {"options": {"post_grad_fusion_options": {"decompose_mm_pass": {}}, "emulate_precision_casts": True}}

    def in_mode(self, fn: Callable, mode: str) -> Callable:
        """``fn`` run in ``mode``, its results computed (not merely queued) on return."""
        self._check_mode(mode)
        if mode == "compile":
            return self.compile(fn)

        def run(*args, **kwargs):
            with self.mode(mode):
                out = fn(*args, **kwargs)
                if mode == "defer_and_fuse":
                    self.flush()
            return out

        return run

    def _device_counts(self) -> tuple[int | None, int | None]:
        if self.name == "xla":

            def count(metric):
                data = self._met.metric_data(metric)
                return data[0] if data else 0

            return (
                count("CompileTime") + count("EagerOpCompileTime"),
                count("ExecuteTime") + count("EagerOpExecuteTime"),
            )
        if self.name == "tpu":
            # private, but TorchTPU's only counter of eager/fused programs (a dict or an object by version)
            stats = torch.tpu._get_cache_stats()
            get = stats.get if isinstance(stats, dict) else lambda key: getattr(stats, key)
            return get("num_cache_reqs") - get("num_cache_hits"), get("num_cache_reqs")
        return None, None

    def counts_executions(self, mode: str) -> bool:
        """Whether ``compile_counter`` sees ``mode``'s launches: TorchTPU counts its eager program cache, which a
        compiled call bypasses."""
        return self.name == "xla" or (self.name == "tpu" and mode != "compile")

    def programs_compiled(self) -> int | None:
        return self._device_counts()[0]

    @contextlib.contextmanager
    def compile_counter(self):
        """Count what gets compiled inside the block (a ``CompileCount``)."""
        from torch._dynamo.utils import counters

        self.sync()  # let launches made before the block finish and be counted before it
        graphs0 = counters["stats"]["unique_graphs"]
        programs0, executions0 = self._device_counts()
        result, start = CompileCount(), time.perf_counter()
        try:
            yield result
        finally:
            self.sync()
            result.seconds = time.perf_counter() - start
            programs1, executions1 = self._device_counts()
            result.graphs = counters["stats"]["unique_graphs"] - graphs0
            if programs0 is not None:
                result.programs = programs1 - programs0
                result.executions = executions1 - executions0


def get_backend(name: str | None = None) -> Backend:
    """The backend named here, else by ``$HELPERS_BACKEND``, else the detected one. Picked by itself, it first checks
    this machine: a TPU chip TorchTPU did not bring up raises (host numbers must not pass for a TPU's), one it cannot
    drive is named."""
    asked = name or os.environ.get(ENV_VAR)
    name = asked or detect()
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}: pick one of {', '.join(BACKENDS)} (or unset {ENV_VAR}).")
    if not asked and name in ("cuda", "cpu"):  # picked by itself: a TPU chip here would go unused
        chips, not_driven = tpu_scan()
        if not_driven and not chips:
            warnings.warn(
                "a TPU is here that TorchTPU cannot drive, so it is not used: " + "; ".join(not_driven), stacklevel=2
            )
        if chips:
            raise BackendError(
                f"this machine has a TPU ({', '.join(chips)}) but TorchTPU did not come up in this Python: run the "
                "set-up cell (it installs torch_tpu), restart the runtime if it says so (Runtime > Restart session), "
                f"then run all cells; to run on the host instead, set {ENV_VAR}=cpu."
            )
    _check_available(name)
    return Backend(name)
