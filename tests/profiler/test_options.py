import json

import pytest

from stepscope.profiler import options
from stepscope.profiler.schedule import Schedule, from_range


def test_parse_full():
    o = options.parse(json.dumps({
        "dir": "/tmp/x", "schedule": {"wait": 1, "warmup": 1, "active": 2, "repeat": -1},
        "timer_only": False, "levels": ["detail", "summary"], "host_metrics": True,
        "sample_interval_s": 0.25, "buffer_bytes": 1024, "rank": 2,
    }))
    assert o["schedule"] == Schedule(wait=1, warmup=1, active=2, repeat=-1)
    assert o["levels"] == ("summary", "detail")
    assert o["sample_interval_s"] == 0.25 and o["rank"] == 2 and o["dir"] == "/tmp/x"


def test_range_schedule_and_env():
    o = options.from_env({"STEPSCOPE_OPTIONS": '{"schedule": [2, 5], "levels": "summary"}'})
    assert o == {"schedule": from_range(2, 5), "levels": ("summary",)}
    assert options.from_env({}) == {}
    assert options.from_env({"STEPSCOPE_OPTIONS": "  "}) == {}


def test_dumps_roundtrip():
    o = {"dir": "d", "schedule": Schedule(skip_first=1, active=3), "levels": ("summary",)}
    assert options.parse(options.dumps(o)) == o


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "STEPSCOPE_OPTIONS is not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"dri": "x"}', "unknown key(s) ['dri']"),
        ('{"timer_only": "yes"}', "'timer_only' must be true or false"),
        ('{"sample_interval_s": 0}', "'sample_interval_s' must be a number > 0"),
        ('{"rank": -1}', "'rank' must be an integer >= 0"),
        ('{"levels": ["full"]}', "'levels' must be a non-empty list"),
        ('{"schedule": {"active": 0}}', "'schedule': schedule: active must be >= 1"),
        ('{"schedule": [5, 2]}', "end must be greater than start"),
        ('{"dir": ""}', "'dir' must be a non-empty string"),
    ],
)
def test_errors(text, message):
    with pytest.raises(ValueError) as e:
        options.parse(text)
    assert message in str(e.value)
