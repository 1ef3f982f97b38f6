"""Recording the order groups run in, to prefetch along it."""

from __future__ import annotations

from torchsurgery.offloading.order import OrderRecorder


def test_order_recorder_prefetches_along_the_recorded_order() -> None:
    order = OrderRecorder()
    assert order.ahead("a", 1) == []  # nothing recorded yet
    first = ["enc.0", "enc.1", "dec.0", "enc.0", "dec.1"]  # a shared block runs twice, out of creation order
    for name in first:
        order.ran(name)
    order.end_forward()
    assert order.recorded == first
    order.ran("enc.0")
    assert order.ahead("enc.0", 2) == ["enc.1", "dec.0"]
    order.ran("enc.1")
    order.ran("dec.0")
    order.ran("enc.0")  # second occurrence: prefetch what followed it last time
    assert order.ahead("enc.0", 1) == ["dec.1"]
    assert order.misses == 0
    order.ran("other")  # out of order: a miss, and the next forward's order is the new one
    order.end_forward()
    assert order.misses == 1 and order.recorded[-1] == "other"
    assert order.ahead("missing", 3) == []
