"""The built-in registry's entries and the model ids their provider retired.

Prices are US dollars per million tokens, from the provider's models overview and
pricing pages (sources and the date checked: docs/reference/models.md). Check them
again when a model is added or its provider changes a price.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The demo replay script shipped with agentbox (used by the offline demo).
DEMO_SCRIPT = Path(__file__).parent / "demo" / "demo.yaml"

#: Upstream model ids the provider has retired, and when (requests to them fail).
#: ``agentbox doctor`` warns about a registry entry naming one. Sources: the provider's
#: model-deprecations page and release notes (docs/reference/models.md, checked 2026-12-07).
RETIRED_MODELS: Mapping[str, str] = {
    "claude-sonnet-4-5": "2026-11-30",
    "claude-sonnet-4-5-20250929": "2026-11-30",
    "claude-sonnet-4-0": "2026-06-15",
    "claude-sonnet-4-20250514": "2026-06-15",
    "claude-opus-4-0": "2026-06-15",
    "claude-opus-4-20250514": "2026-06-15",
    "claude-opus-4-1": "2026-08-05",
    "claude-opus-4-1-20250805": "2026-08-05",
    "claude-3-7-sonnet-latest": "2026-02-19",
    "claude-3-7-sonnet-20250219": "2026-02-19",
    "claude-3-5-sonnet-20241022": "2025-10-22",
    "claude-3-5-sonnet-20240620": "2025-10-22",
}

BUILTIN: dict[str, dict[str, Any]] = {
    # DEFAULT_MODEL: the offline demo, needs no key.
    "replay-demo": {
        "kind": "replay",
        "upstream": str(DEMO_SCRIPT),
        "upstream_model": "replay-demo",
        "description": "Offline scripted model: writes a function and its test, runs them.",
    },
    "opus": {
        "kind": "anthropic",
        "upstream": "https://api.anthropic.com",
        "upstream_model": "claude-opus-5-5",
        "key_env": "ANTHROPIC_API_KEY",
        "description": "Claude Opus 5.5 through the Anthropic API (key from the host env).",
        "price": {"input": 4.0, "output": 20.0, "cache_write": 5.0, "cache_write_1h": 8.0,
                  "cache_read": 0.2},
    },
    "sonnet": {
        "kind": "anthropic",
        "upstream": "https://api.anthropic.com",
        "upstream_model": "claude-sonnet-5-5",
        "key_env": "ANTHROPIC_API_KEY",
        "description": "Claude Sonnet 5.5 through the Anthropic API (key from the host env).",
        "price": {"input": 2.0, "output": 10.0, "cache_write": 2.5, "cache_write_1h": 4.0,
                  "cache_read": 0.1},
    },
    "haiku": {
        "kind": "anthropic",
        "upstream": "https://api.anthropic.com",
        "upstream_model": "claude-haiku-5-5",
        "key_env": "ANTHROPIC_API_KEY",
        "description": "Claude Haiku 5.5 through the Anthropic API (key from the host env).",
        # The prompts-up-to-100k-tokens rates; longer prompts cost 5x (not modelled).
        "price": {"input": 0.1, "output": 0.5, "cache_write": 0.125, "cache_write_1h": 0.2,
                  "cache_read": 0.01},
    },
}  # fmt: skip
