"""Which device we run on, and the three execution modes mapped onto it.

Backends: ``tpu`` (TorchTPU, device "tpu"), ``xla`` (PyTorch/XLA, a TPU or its CPU client),
``cuda`` and ``cpu``. Modes: ``eager``, ``defer_and_fuse`` and ``compile``.

Every call into ``torch_tpu`` lives in this module, and ``torch_xla`` is imported only when
the ``xla`` backend is asked for: importing either on a machine without their hardware can
hang or abort the process (see ``docs/torch_tpu.md``).
"""

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

from .tpu import tpu_scan

BACKENDS = ("tpu", "xla", "cuda", "cpu")
MODES = ("eager", "defer_and_fuse", "compile")
ENV_VAR = "HELPERS_BACKEND"
_DEFER_AND_FUSE_BACKENDS = ("tpu", "xla")
_COMPILE_BACKEND = {"tpu": "tpu", "xla": "openxla", "cuda": "inductor", "cpu": "inductor"}
# The TPU this course targets, as published (the figures the course did not measure, apart from
# ``sources``' measurements of others: the backend is where they are used).
# v5e's int8 peak, "393 TOPS (exactly 2x bf16)", the vendor's figure as quoted in xbill9/gemma4-dev,
# tpu-vllm-v5e1-2b/devto-vllm-gemma4-e2b-v5e1.md
V5E_INT8_OPS = 393e12
# Google's published HBM bandwidth and bf16 peak of one TPU v5e chip.
V5E_BYTES_PER_S = 819e9
V5E_BF16_FLOPS = 197e12
# The HBM a v5e-1 gives programs, in the device's own units: 15.75 GiB, as it reported itself to
# vLLM TPU ("total_hbm_limit_gb=15.75GiB", xbill9/gemma4-dev, jev-tpu-v5e1/evidence-v5e1/
# kv-and-memory.txt); Google's page says "16 GB" of HBM. Where a device is at hand, its own
# reported limit is used instead (``Backend.memory_total``).
V5E_HBM_GIB = 15.75
V5E_HBM_BYTES = int(V5E_HBM_GIB * 2**30)
AUDIT_VAR = "HELPERS_XLA_AUDIT"  # set (to 1) before the xla backend starts: XLA dumps what it compiles
DUMP_FLAGS = "--xla_dump_to={} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*"
GENERATION_TOKENS = 32  # tokens per run in the series (``Backend.generation_length``)
TIMED_TOKENS = 128  # tokens per timed decode run, as gpt-fast times (``Backend.timed_length``)


class BackendError(RuntimeError):
    """A backend or mode that this machine cannot give; the message says what to do."""


def _tpu_present() -> bool:
    # TorchTPU renames PrivateUse1 to "tpu" only when a TPU is really there; never call
    # torch.tpu.is_available(): it raises on torch >= 2.11.
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and accelerator.type == "tpu"


def _xla_asked() -> bool:
    # PJRT_DEVICE is how PyTorch/XLA is told which client to make: setting it is asking for XLA.
    return "PJRT_DEVICE" in os.environ and importlib.util.find_spec("torch_xla") is not None


def detect() -> str:
    """The backend this machine offers: tpu, then xla (if PJRT_DEVICE is set), cuda, cpu.

    A machine with a TPU chip where TorchTPU did not come up raises rather than falling back
    to cpu: numbers measured on the host must not pass for the TPU's."""
    if _tpu_present():
        return "tpu"
    if _xla_asked():
        return "xla"
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
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


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
    """Where XLA dumps what it compiles in this process, if it was told to (``XLA_FLAGS``)."""
    found = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return pathlib.Path(found.group(1)) if found else None


def enable_dump() -> pathlib.Path:
    """The folder XLA dumps every compiled module into: set in ``XLA_FLAGS`` now, so call it
    before the xla backend's first device use (XLA reads its flags once, when its client starts).
    Reuses a dump folder already set there."""
    if dump_folder():
        return dump_folder()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="xla-dump-"))
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DUMP_FLAGS.format(folder)}".strip()
    return folder


@dataclasses.dataclass
class CompileCount:
    """What was compiled inside a ``with backend.compile_counter() as c:`` block.

    graphs: graphs dynamo captured for ``torch.compile``.
    programs: device programs the backend compiled (lazy/fused and eager op programs);
        None where the backend does not count them (cpu, cuda).
    executions: device program launches; None where the backend does not count them.
    seconds: the block's wall time, the device synced at both ends (a first call: its compile).
    """

    graphs: int = 0
    programs: int | None = None
    executions: int | None = None
    seconds: float = 0.0


class Backend:
    """One backend: its device, its three modes, sync, memory and compile counts.

    Args: ``name``, one of ``BACKENDS`` (``get_backend`` checks it is available first).
    Attributes: ``name``; ``device``, the ``torch.device`` tensors go to; ``modes``, the
    execution modes it offers. ``memory()`` returns ``{"in_use", "peak"}`` bytes or None;
    ``compile_counter()`` yields a ``CompileCount`` filled when the block ends. A ``cpu``
    backend sets inductor's ``cpp.dynamic_threads`` for the process (kernels that read the thread
    count when they run)."""

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
            # On the CPU client a sync waits for its graph: in CI, torch_xla 2.9 crashed (SIGSEGV,
            # SIGABRT) at the first read issued while an async sync's graph was still running.
            self._sync_waits = os.environ["PJRT_DEVICE"] == "CPU"
        else:
            self.device = torch.device(name)
        if name == "cpu":
            # inductor's CPU kernels read the thread count when they run instead of baking in
            # today's (a setting of inductor's module, for the whole process): the same kernels
            # for one thread (a test worker) and for the machine's default (a reader), so one
            # compile cache serves both
            inductor_config.cpp.dynamic_threads = True

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, device={self.device})"

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.defers_ops else ("eager", "compile")

    # --- policy: what the rest of the course asks of a backend, decided here only ----------
    @property
    def defers_ops(self) -> bool:
        """Whether eager ops can be deferred and fused into device programs (tpu, xla): there a
        graph that changes shape each step (HF's default cache) is a new compile each step."""
        return self.name in _DEFER_AND_FUSE_BACKENDS

    @property
    def lazy(self) -> bool:
        """PyTorch/XLA's lazy tensors (xla): every op is recorded and runs when synced, as one XLA
        program; on its CPU client each new program is a compile of seconds to minutes."""
        return self.name == "xla"

    @property
    def on_tpu(self) -> bool:
        """Whether programs run on a TPU chip: TorchTPU, or PyTorch/XLA with ``PJRT_DEVICE=TPU``."""
        return self.name == "tpu" or (self.lazy and os.environ.get("PJRT_DEVICE") == "TPU")

    @property
    def default_model(self) -> str:
        """What the series loads here unless told (``hub.choose_checkpoint``): ``"e2b"`` on a TPU
        (E2B's ~9 GB fit a v5e-1), ``"e2b if it fits"`` on a CUDA GPU (a Colab T4 or L4 when there
        is no TPU quota), ``"twin"`` on the host and on XLA's CPU client."""
        return {"tpu": "e2b", "cuda": "e2b if it fits"}.get(self.name, "twin")

    @property
    def load_device_map(self) -> dict[str, str]:
        """``from_pretrained``'s ``device_map``, set explicitly: transformers places nothing on a
        TPU by itself. accelerate cannot place onto PyTorch/XLA devices, so on xla the weights
        load on the host and ``place`` moves them."""
        return {"": "cpu"} if self.lazy else {"": str(self.device)}

    def place(self, model):
        """A model loaded with ``load_device_map``, on the device: on xla moved there and its
        tied weights tied again (moving onto an XLA device makes new tensors); else as it is."""
        if self.lazy:
            model.to(self.device)
            model.tie_weights()
        return model

    @property
    def generation_length(self) -> int:
        """Tokens generated per run in the series: ``GENERATION_TOKENS``; 8 on xla, where HF
        ``generate`` compiles a new program at every step."""
        return 8 if self.lazy else GENERATION_TOKENS

    @property
    def timed_length(self) -> int:
        """Tokens per timed decode run: ``TIMED_TOKENS`` (a rate over the twin's 32 tokens is a
        few milliseconds, mostly noise); on xla, ``generation_length``: timings there measure
        the CPU client, not a TPU."""
        return self.generation_length if self.lazy else TIMED_TOKENS

    @property
    def runs_compiled_generate(self) -> bool:
        """Whether HF ``generate`` may run with a compiled forward: not on xla, where it crashed
        torch_xla 2.9's process at generate's stop check (SIGSEGV or SIGABRT, twice of two)."""
        return not self.lazy

    @property
    def published_bandwidth(self) -> tuple[float, str] | None:
        """The device's published read bandwidth and its source, where the course uses it in
        place of a measurement: on a TPU, Google's v5e figure; None elsewhere (measured)."""
        return (V5E_BYTES_PER_S, "published: TPU v5e, 819 GB/s") if self.on_tpu else None

    @property
    def xla_dump_folder(self):
        """Where XLA dumps the programs it compiles, on xla when told to (``HELPERS_XLA_AUDIT=1``
        before the backend starts); None elsewhere."""
        return dump_folder() if self.lazy else None

    @property
    def profiler_activities(self) -> list:
        """What torch.profiler records here: the host everywhere, a GPU's kernels on cuda. On tpu
        and xla it sees the host's side only (dispatch, guards, waiting for the device)."""
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.name == "cuda" else [])

    @property
    def profiler_sort(self) -> str:
        """The profiler table's column for time spent on this device."""
        return "self_cuda_time_total" if self.name == "cuda" else "self_cpu_time_total"

    def describe(self) -> str:
        """One line a reader can trust: backend, device and its memory."""
        parts = [f"backend {self.name}", f"device {self.device}"]
        if self.name == "cuda":
            parts.append(torch.cuda.get_device_name(self.device))
        total = self.memory_total()
        if total:
            parts.append(f"{total / 2**30:.1f} GiB device memory")
        if self.name == "xla":
            parts.append(f"PJRT_DEVICE={os.environ['PJRT_DEVICE']}")
        parts.append(f"{torch.get_num_threads()} CPU threads")  # what the host's ops run on (a reader's default)
        return ", ".join(parts)

    # --- waiting and memory -------------------------------------------------------------
    def sync(self) -> None:
        """Wait until every queued device op has finished. On a TPU, ``torch.accelerator.synchronize``:
        in TorchTPU's sources it reaches the device guard's ``synchronizeDevice``, which first
        launches every deferred op (``MaterializeAll``) and then waits for each stream's
        executions and copies, so a timing or a count after it covers programs that ran (its
        Python docstring, "waits for all pending d2h copies", is older than that). Read in the
        sources, not run: no machine building this course has a TPU."""
        if self.name == "xla":
            self._xm.wait_device_ops()
        elif self.name in ("tpu", "cuda"):
            torch.accelerator.synchronize()

    def memory(self) -> dict[str, int] | None:
        """Bytes in use and peak on the device, from the backend's own counters (None on cpu)."""
        if self.name in ("tpu", "cuda"):
            return {"in_use": torch.accelerator.memory_allocated(), "peak": torch.accelerator.max_memory_allocated()}
        if self.name == "xla":
            info = self._xla_memory_info()
            return info and {"in_use": info["bytes_used"], "peak": info.get("peak_bytes_used", info["bytes_used"])}
        return None

    def _xla_memory_info(self) -> dict | None:
        try:
            return self._xm.get_memory_info(self.device)
        except RuntimeError:  # the CPU client has no allocator stats ("GetAllocatorStats is not supported")
            return None

    def empty_cache(self) -> None:
        """Hand the allocator's cached blocks back to the device (after a model is dropped)."""
        if self.name in ("tpu", "cuda"):
            torch.accelerator.empty_cache()

    def reset_peak_memory(self) -> None:
        if self.name in ("tpu", "cuda"):
            torch.accelerator.reset_peak_memory_stats()

    def memory_total(self) -> int | None:
        """Device memory in bytes as the backend reports it (None on cpu): CUDA's total, XLA's
        ``bytes_limit``, TorchTPU's HBM per device (its table by chip kind: 16 GiB for a v5e;
        without it, the limit a v5e-1 reports to programs, ``V5E_HBM_BYTES``)."""
        if self.name == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        if self.name == "tpu":
            try:
                return torch.tpu.get_device_properties(self.device).total_memory
            except (AttributeError, RuntimeError):
                return V5E_HBM_BYTES
        if self.name == "xla":
            return (self._xla_memory_info() or {}).get("bytes_limit")
        return None

    def free_bytes(self) -> int | None:
        """Free device memory where the backend says it (its total less what is in use); host
        RAM on cpu; None where neither is known."""
        total = self.memory_total()
        if total is not None:
            return total - (self.memory() or {"in_use": 0})["in_use"]
        if self.name == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return None

    # --- the three modes ----------------------------------------------------------------
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
            with torch.tpu.set_eager_mode(eager):
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
        """``torch.compile`` with this backend's compiler; static shapes unless told otherwise.

        ``dynamic=False`` is what TorchTPU accepts, and it makes every new shape a new
        compilation, which is the lesson of notebook 01.
        """
        options.setdefault("dynamic", False)
        return torch.compile(fn, backend=_COMPILE_BACKEND[self.name], **options)

    def donate(self, *tensors: torch.Tensor) -> None:
        """Inside a compiled function: ``tensors`` are written in place there (a KV cache), so
        their buffers may be reused for the program's outputs, not copied whole into new ones.
        PyTorch/XLA's dynamo bridge aliases an input only when it is marked a buffer donor, in
        the graph (``dynamo_set_buffer_donor_``); without it, every call writes a new copy of
        each (measured by ``helpers.course.programs``). TorchTPU 0.2.0's compile offers no such mark (its
        sources: mutated inputs are functionalized, the program returns new buffers, the tensor
        is pointed at them after the call); inductor (cpu, cuda) writes in place by itself."""
        if self.name == "xla":
            for tensor in tensors:
                torch.ops.xla.dynamo_set_buffer_donor_(tensor, True)

    def set_float32_matmuls_exact(self) -> None:
        """On a TPU, float32 matmuls run in bf16 passes unless told otherwise: set torch's global
        float32 matmul precision to "highest" there (a process-wide setting, named as such), so
        the float32 twin's exact comparisons hold. Nothing to do elsewhere."""
        if self.name == "tpu":
            torch.set_float32_matmul_precision("highest")

    @property
    def int4_by_planes(self) -> bool:
        """Whether packed int4 times a decode row goes plane by plane (``int4.packed_linear``):
        on a CPU, where inductor left the columns form a scalar loop (five times slower); elsewhere
        the dequantized weight's matmul, which a TPU's or GPU's compiler may fuse into its matrix
        unit, where the planes' products would be elementwise work."""
        return self.name == "cpu"

    def use_matvec_loops(self) -> dict | None:
        """``compile`` options that make a decode step's one-row matmuls loops inductor writes
        (multiply and sum) instead of calls to the BLAS matrix-vector product: inductor's own
        ``decompose_mm_pass``. A compressed weight is dequantized in the same kernel, into a
        buffer of one weight that stays in the CPU's cache. CPU only (None elsewhere): the pass
        decomposes one-row matmuls on the CPU alone, where MKL reads a decode step's short
        weight rows at well under half the bandwidth of a plain read, and these loops at two to
        three times MKL's rate (``benchmarks/matvec.py``). It also raises the pass's size limit,
        a setting of inductor's module for the whole process (the pass has no per-compile knob)."""
        if self.name != "cpu":
            return None
        from torch._inductor.fx_passes import decompose_mem_bound_mm

        # read once, at the pass's import: its default (2048 rows) leaves the vocabulary-wide head to MKL
        decompose_mem_bound_mm.cpu_max_other_dimension_decomposition = 2**31
        # emulate_precision_casts: a dequantized weight is rounded to bf16 inside the loop, as the
        # checkpoint's values are, not kept in float32 (measured: logits 0.36 off without it)
        return {"options": {"post_grad_fusion_options": {"decompose_mm_pass": {}}, "emulate_precision_casts": True}}

    def in_mode(self, fn: Callable, mode: str) -> Callable:
        """``fn`` made to run in ``mode``, its results computed (not merely queued) on return."""
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

    # --- counting compilations ----------------------------------------------------------
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
            # private, but TorchTPU's only counter for eager/fused programs; a dict or an object
            # depending on the version: every cache miss is one compilation.
            stats = torch.tpu._get_cache_stats()
            get = stats.get if isinstance(stats, dict) else lambda key: getattr(stats, key)
            return get("num_cache_reqs") - get("num_cache_hits"), get("num_cache_reqs")
        return None, None

    def counts_executions(self, mode: str) -> bool:
        """Whether ``compile_counter`` sees the launches of ``mode``: PyTorch/XLA counts every
        execution; TorchTPU counts its eager program cache, which a compiled call bypasses (it
        runs its executable directly), so there a compiled call would read 0."""
        return self.name == "xla" or (self.name == "tpu" and mode != "compile")

    def programs_compiled(self) -> int | None:
        """Device programs compiled so far in this process (None where not counted)."""
        return self._device_counts()[0]

    @contextlib.contextmanager
    def compile_counter(self):
        """Count what gets compiled inside the block (see ``CompileCount``)."""
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
    """The backend named here, else by ``$HELPERS_BACKEND``, else the detected one."""
    name = name or os.environ.get(ENV_VAR) or detect()
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}: pick one of {', '.join(BACKENDS)} (or unset {ENV_VAR}).")
    _check_available(name)
    return Backend(name)
