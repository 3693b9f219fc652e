"""Activation names that models tag with `jax.ad_checkpoint.checkpoint_name`.

The library's models tag every activation a policy may refer to exactly once, at the point listed
here, with one of these constants. Your own model may use these names (then the selective presets
apply to it) or its own: `register("query", ...)` makes `save_names:query` (and `offload_names:`,
`custom:`) accept them. docs/tagging.md shows both.

| name            | where it is tagged                                               |
|-----------------|------------------------------------------------------------------|
| `block_input`   | the input of each transformer layer (the residual stream)       |
| `ln_1`          | output of the norm before attention                              |
| `qkv`           | the q, k, v projections (after RoPE for LLaMA)                   |
| `attn_probs`    | the attention core's saved state: the (B,H,T,T) probabilities of |
|                 | a plain core; with `attention="cudnn"` every residual cuDNN's    |
|                 | VJP keeps (q, k, v, output, softmax statistics). The tiled and   |
|                 | xla cores keep only q, k, v and the log-sum-exp (untagged)       |
| `attn_context`  | the attention core's output, heads merged (B,T,C)                |
| `attn_out`      | the attention output projection                                  |
| `ln_2`          | output of the norm before the MLP                                |
| `mlp_up`        | the MLP up projection (`c_fc`)                                   |
| `mlp_gate`      | the gate projection of a gated MLP (`c_fc2`, LLaMA only)         |
| `mlp_act`       | the MLP activation (GELU, or silu(gate)·up)                      |
| `mlp_out`       | the MLP down projection (`c_proj`)                               |
| `lm_head`       | the LM head's float32 logits (B,T,V), or one chunk's (B,N,V)     |
"""
import re

__all__ = ["BLOCK_INPUT", "LN_1", "QKV", "ATTN_PROBS", "ATTN_CONTEXT", "ATTN_OUT", "LN_2", "MLP_UP", "MLP_GATE",
           "MLP_ACT", "MLP_OUT", "LM_HEAD", "ALL", "MODULES", "register", "known", "path_tag", "tag_tree"]

BLOCK_INPUT = "block_input"
LN_1 = "ln_1"
QKV = "qkv"
ATTN_PROBS = "attn_probs"
ATTN_CONTEXT = "attn_context"
ATTN_OUT = "attn_out"
LN_2 = "ln_2"
MLP_UP = "mlp_up"
MLP_GATE = "mlp_gate"
MLP_ACT = "mlp_act"
MLP_OUT = "mlp_out"
LM_HEAD = "lm_head"

ALL = (BLOCK_INPUT, LN_1, QKV, ATTN_PROBS, ATTN_CONTEXT, ATTN_OUT, LN_2, MLP_UP, MLP_GATE,
       MLP_ACT, MLP_OUT, LM_HEAD)

# Selective recompute modules (Megatron's `recompute_modules`): the tagged names each one drops
# from the saved set, so that they (and every untagged value computed from them) are recomputed.
MODULES = {
    "core_attn": (ATTN_PROBS,),
    "mlp": (MLP_UP, MLP_GATE, MLP_ACT),
    "norm": (LN_1, LN_2),
}

_USER: set = set()


def register(*tags: str) -> None:
    """Accept `tags` (names your model gives `jax.ad_checkpoint.checkpoint_name`) in the name-based
    policies (`save_names:`, `offload_names:`, `custom:`), beside the library's names.

    Example:
      >>> register("query", "scores")
      >>> "query" in known()
      True
    """
    for t in tags:
        if not isinstance(t, str) or not t or any(c in t for c in ",=:+ "):
            raise ValueError(f"tag name {t!r} must be a non-empty string without ',', '=', ':', '+' or spaces")
    _USER.update(tags)


def known() -> tuple[str, ...]:
    """The library's names, then the registered ones."""
    return ALL + tuple(sorted(_USER - set(ALL)))


_NOT_IN_TAGS = re.compile(r"[\s,=:+;]")   # what a tag name or a plan's text cannot hold


def path_tag(parts) -> str:
    """The tag of a submodule at module path `parts` below its layer: the parts joined by '.',
    whitespace and `,=:+;` made `_` (the name `tag_submodules` of remat.linen and remat.nnx gives).

    Example:
      >>> path_tag(("attn", "c_attn")), path_tag(("mlp", 0))
      ('attn.c_attn', 'mlp.0')
    """
    return ".".join(_NOT_IN_TAGS.sub("_", str(p)) for p in parts)


def tag_tree(out, name: str):
    """`checkpoint_name(leaf, name)` on every floating array leaf of `out`, and `name` registered;
    `out` itself when it has no floating array.

    Example:
      >>> import jax.numpy as jnp
      >>> tag_tree((jnp.ones(2), 3), "x")[1]
      3
    """
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    floating = lambda a: isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.inexact)
    if not any(floating(a) for a in jax.tree.leaves(out)):
        return out
    register(name)
    return jax.tree.map(lambda a: checkpoint_name(a, name) if floating(a) else a, out)
