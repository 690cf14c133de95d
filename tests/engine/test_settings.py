"""Settings reject out-of-range values, naming the field."""

from __future__ import annotations

import pytest

from kvfleet.engine.settings import EngineSettings, ServerSettings


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size_tokens": 0}, "block_size_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
        ({"num_kv_blocks": -1}, "num_kv_blocks"),
        ({"device": "tpu"}, "device"),
        ({"kv_cache_memory_bytes": 10}, "kv_cache_memory_bytes"),
    ],
)
def test_engine_settings_name_the_bad_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineSettings(**kwargs)  # type: ignore[arg-type]


def test_server_settings_bounds() -> None:
    with pytest.raises(ValueError, match=r"^port:"):
        ServerSettings(port=70000)
    with pytest.raises(ValueError, match=r"^retry_after_s:"):
        ServerSettings(retry_after_s=0)
    assert EngineSettings().max_num_batched_tokens >= EngineSettings().max_num_seqs
