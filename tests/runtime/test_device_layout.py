"""The device layout's arithmetic, and opening the devices a layout needs."""

from __future__ import annotations

import pytest

from kiln.runtime.device_layout import DeviceLayout
from kiln.runtime.devices import open_devices
from kiln.runtime.errors import ModelLoadError


def test_stages_are_contiguous_and_as_even_as_can_be():
    assert DeviceLayout(pipeline_parallel=4).stage_layers(30) == [range(0, 8), range(8, 16), range(16, 23),
                                                                   range(23, 30)]
    assert DeviceLayout().stage_layers(2) == [range(0, 2)]


def test_device_order_is_stage_major():
    layout = DeviceLayout(tensor_parallel=3, pipeline_parallel=2)
    assert layout.device_count == 6
    assert [layout.device(s, r) for s in range(2) for r in range(3)] == list(range(6))


def test_page_elements_split_a_whole_page():
    whole = 30 * 2 * 3 * 16 * 64  # SmolLM2: 30 layers, 3 K/V heads, stride 16, head size 64
    for tp, pp in [(1, 1), (3, 1), (1, 2), (3, 4)]:
        parts = DeviceLayout(tp, pp).page_elems(30, 3, 16, 64)
        assert len(parts) == tp * pp and sum(parts) == whole


@pytest.mark.parametrize("layout,needle", [
    (DeviceLayout(tensor_parallel=2), "does not divide the model's 3 key/value heads"),
    (DeviceLayout(pipeline_parallel=31), "more stages than the model's 30 layers"),
])
def test_a_layout_the_model_cannot_take_says_why(layout, needle):
    assert needle in layout.problem(layers=30, heads=9, kv_heads=3, intermediate=1536)
    assert DeviceLayout(3, 2).problem(layers=30, heads=9, kv_heads=3, intermediate=1536) is None


def test_cpu_devices_are_distinct_instances():
    first, second = open_devices("local-task", 2)
    assert first is not second
    assert len(open_devices("local-task,local-task", 2)) == 2


@pytest.mark.parametrize("uri,count,needle", [
    ("local-task,local-task,local-task", 2, "3 devices were named"),
    ("no-such-driver", 2, "cannot open device 'no-such-driver'"),
    ("no-such-driver", 1, "cannot open device 'no-such-driver'"),
])
def test_devices_that_cannot_be_opened_say_why(uri, count, needle):
    with pytest.raises(ModelLoadError, match=needle):
        open_devices(uri, count)
