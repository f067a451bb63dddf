"""A small multimodal inference server built on the Dispatcher: a vision
encoder and a text model (CPU torch modules made in code, no downloads)
behind one device worker that also calls NVIDIA's real libcudart per batch
(a cudaLaunchKernel and a cudaStreamSynchronize: without a driver they fail
at once, but they are entered, so the agent's GPU probes see a submitting
thread). Batches run one after the other on the device, so a text request
that arrives during a vision batch waits for it: the vision batch cap is
what bounds the text stream's tail.

The hint gate lets a run compare the same server with hints on and off
under the same load (off: the dispatcher ignores hints; on again: the
latest hints still within their TTL apply at once)."""

import ctypes
import gc
import importlib.util
import threading
import time
from pathlib import Path

import torch
from torch import nn

from mmtrace.detectors.attention_entropy import watch
from mmtrace.dispatch import Dispatcher

IMAGE = (3, 224, 224)
TOKENS = 24
VOCAB = 1000
DEVICE = "gpu0"
# Text requests of several streams share a decode step (up to 4, waiting at
# most 5 ms for company), so the text queue keeps up between vision batches
# even though high-priority vision runs after at most 4 text batches.
QUEUES = {"text": {"batch_max": 4, "wait_ms": 5}}


def cudart_path() -> Path:
    """libcudart.so.12 of the nvidia-cuda-runtime-cu12 wheel."""
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    for location in (spec.submodule_search_locations if spec else None) or []:
        lib = Path(location) / "lib" / "libcudart.so.12"
        if lib.exists():
            return lib
    raise FileNotFoundError("libcudart.so.12: expected the nvidia-cuda-runtime-cu12 wheel, "
                            "found none (pip install nvidia-cuda-runtime-cu12)")


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class CudaRuntime:
    """The two calls a batch makes; their return codes are counted, not
    raised (no driver here: cudaErrorInsufficientDriver)."""

    def __init__(self, path: Path | None = None):
        self.lib = ctypes.CDLL(str(path or cudart_path()))
        self.lib.cudaLaunchKernel.argtypes = [ctypes.c_void_p, _Dim3, _Dim3,
                                              ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                              ctypes.c_void_p]
        self.lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        # Any code address stands for the kernel's host stub.
        self.kernel = ctypes.cast(self.lib.cudaGetLastError, ctypes.c_void_p).value
        self.calls = 0
        self.last_rc = None

    def launch(self, n: int):
        self.last_rc = self.lib.cudaLaunchKernel(self.kernel, _Dim3(n, 1, 1), _Dim3(128, 1, 1),
                                                 None, 0, None)
        self.calls += 1

    def sync(self):
        self.lib.cudaStreamSynchronize(None)
        self.calls += 1


def vision_encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, stride=1, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 128)).eval()


class TextModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(VOCAB, 64)
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, tokens):
        return self.head(self.layer(self.embed(tokens))[:, -1]).argmax(-1)


class GatedDispatcher(Dispatcher):
    """A Dispatcher whose hints can be switched off and on, and that keeps a
    log of every hint it applied (with the agent's detection time)."""

    def __init__(self, *args, **kwargs):
        self.hints_on = True
        self.applied: list[dict] = []
        self._held: dict[tuple, tuple[dict, int]] = {}
        self._gate = threading.Lock()
        super().__init__(*args, **kwargs)

    def apply_hint(self, hint: dict) -> None:
        with self._gate:
            if isinstance(hint, dict):
                self._held[(hint.get("kind"), hint.get("target"))] = (hint, time.monotonic_ns())
            if self.hints_on:
                self._apply_logged(hint)

    def set_hints(self, on: bool):
        """Off: every active hint is dropped at once (replaced by one that
        lapses in 1 ms). On: the latest hints still in their TTL apply."""
        with self._gate:
            self.hints_on = on
            now = time.monotonic_ns()
            if not on:
                for h in self.state()["hints"]:
                    super().apply_hint({"v": 1, "type": "hint", "kind": h["kind"],
                                        "target": h["target"], "value": h["value"],
                                        "ttl_s": 1e-3, "reason": "hints off"})
                time.sleep(2e-3)
                self.state()                   # expires them
                return
            for hint, received in self._held.values():
                left = hint.get("ttl_s", 0) - (now - received) / 1e9
                if left > 0:
                    self._apply_logged({**hint, "ttl_s": left})

    def _apply_logged(self, hint: dict):
        super().apply_hint(hint)
        evidence = hint.get("evidence") or {}
        self.applied.append({"id": hint.get("id"), "kind": hint["kind"], "target": hint["target"],
                             "value": hint["value"], "applied_ns": time.monotonic_ns(),
                             "detected_ns": evidence.get("detected_ns") if isinstance(evidence, dict) else None})


class DemoServer:
    """The models, the device worker's handler, and the dispatcher."""

    def __init__(self, socket_path, *, entropy_every: int = 20):
        torch.set_num_threads(1)              # one core's worth, like one launch thread
        self.cuda = CudaRuntime()
        self.models = {"vision": vision_encoder(), "text": TextModel().eval()}
        self.batches = {"vision": 0, "text": 0}
        self.dispatcher = GatedDispatcher([DEVICE], self._run_batch, socket=socket_path,
                                          client="mmtrace-demo", queues=QUEUES)
        self.entropy = watch(self.models["text"], every=entropy_every, rows=4,
                             sink=self.dispatcher.entropy_sink, modality="text")
        # What exists by now lives as long as the server: keep it out of the
        # collector's full passes, which stop every thread (a 30 ms pass is
        # ~200 ms of wall time at the CPU share contention leaves us).
        gc.collect()
        gc.freeze()

    def _run_batch(self, device, modality, items):
        with torch.no_grad():
            self.cuda.launch(len(items))
            out = self.models[modality](torch.stack(items))
            self.cuda.sync()
        self.batches[modality] += 1
        return list(out)

    @staticmethod
    def image(seed: int) -> torch.Tensor:
        return torch.randn(IMAGE, generator=torch.Generator().manual_seed(seed))

    @staticmethod
    def prompt(seed: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(seed))

    def close(self):
        gc.unfreeze()
        self.entropy.remove()
        self.dispatcher.close()
