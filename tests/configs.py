"""Small Qwen2-shaped configs for the tests: one definition, each test overriding what it needs."""

from minfer_jax.model.config import Config


def tiny_config(**overrides) -> Config:
    """3 layers of width 256 (4 heads, 2 KV heads, d_ff 512), 512 context, a 300-token vocabulary,
    untied head; keyword overrides replace any field."""
    fields = dict(
        n_layers=3,
        d_model=256,
        n_heads=4,
        n_kv_heads=2,
        d_ff=512,
        context_length=512,
        vocab_size=300,
        rope_theta=1e6,
        rms_eps=1e-6,
        tied_output=False,
    )
    fields.update(overrides)
    return Config(**fields)
