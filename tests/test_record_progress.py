"""`mmtrace record`'s progress line names what was lost by stream and
reason; counters that are not losses are not added in."""

import io

from mmtrace.agent.recording.recorder import Progress
from mmtrace.bpf import counters


def test_losses_are_named_by_stream_and_reason_largest_first():
    seen = {"ringbuf_full_dev": 741_824, "switch_in_unseen": 2, "runq_events": 10**6,
            "dev_events": 5, "name_truncated": 3}
    assert counters.describe_losses(seen) == "741,824 dev ringbuf_full_dev, 2 cpu switch_in_unseen"
    assert counters.describe_losses({"runq_events": 9}) == "none"
    assert counters.stream_of("enqueue_map_full") == "cpu"
    assert counters.stream_of("call_abandoned") == "dev"


def test_the_progress_line_names_each_loss_and_only_losses():
    out = io.StringIO()
    progress = Progress(out, interval_s=0.0)
    progress.update(3.0, 1234, {"runq_events": 1234, "name_truncated": 7}, force=True)
    progress.update(4.0, 2000, {"runq_events": 2000, "ringbuf_full_cpu": 12,
                                "user_read_failed": 3}, force=True)
    first, second = out.getvalue().splitlines()
    assert first.endswith("lost        0")
    assert "lost       15 (12 cpu ringbuf_full_cpu, 3 dev user_read_failed)" in second
