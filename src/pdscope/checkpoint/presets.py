"""The built-in models' shapes (``pdscope make-model``'s presets), readable without torch:
``pdscope serve`` sizes its OpenMP spin count from them before torch loads."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # For tests: ~0.22M parameters, under 1 MB on disk, builds in well under a second.
    "tiny": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    # The embedded default model: ~168.8M parameters (~338 MB in bfloat16).
    "small": {
        "num_hidden_layers": 12,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 16384,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}
