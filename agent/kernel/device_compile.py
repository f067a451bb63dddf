"""The GPU/NPU programs compiled beside the CPU stream, and the probe
state that says so when they do not compile or load."""

import threading

from mmtrace.agent.errors import MmtraceError, os_failure

DEVICE_PROGRAMS = "gpu_npu_programs"


def device_programs_failed(error: Exception) -> dict:
    """The probe state of GPU/NPU programs that did not compile or load:
    no library is probed, and the CPU stream goes on."""
    return {"stream": "gpu/npu", "program": DEVICE_PROGRAMS, "state": "failed",
            "point": "load", "reason": str(error)}


class DeviceCompile:
    """The GPU/NPU programs compiling in a thread while the CPU stream is
    drained (bcc releases the GIL while it compiles)."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, name="mmtrace-compile", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.loaded.compile_device()
        except OSError as exc:          # out of descriptors, most likely: said with the limit
            self.error = os_failure("the GPU/NPU programs could not be readied", exc)
        except Exception as exc:        # told by the loop, which goes on with the CPU
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()

    def ready(self, sources) -> bool:
        """Compiled, and the first discovery scan over (`sources` may be
        None: nothing to wait for): time to finish() and wire."""
        return self.done() and (sources is None or sources.ready())

    def finish(self) -> Exception | None:
        """Wire the compiled programs (once done); why they are not, or None."""
        if self.error is None:
            try:
                self.loaded.load_device()
            except MmtraceError as exc:
                self.error = exc
        else:
            self.loaded.drop_scheduler_module()
        return self.error
