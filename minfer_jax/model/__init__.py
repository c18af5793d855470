"""The Qwen2 model: static config, weight and cache pytrees, pure forward functions."""
