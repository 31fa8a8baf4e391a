"""Float64 eager references for every MLA path; torch only, any device.

Every function returns ``(out, lse)`` with a natural-log lse; rows that see no key give out 0, lse -inf.
Bad input (a shape, a dtype, NaN or inf in an input, a scale that is not a finite positive number) is a ValueError
that names it: the reference is what every impl is judged against, so it never answers from such input.
"""

from reference.absorbed import latent_mqa, paged_latent_mqa
from reference.chunked import chunked_prefill, prefill_with_context
from reference.core import attend, ragged_attention
from reference.dcp import dcp_latent_mqa
from reference.expected import Expected, expected
from reference.merge import merge_attn_states, merge_many
from reference.mha import mha_attention
from reference.sparse import indexed_latent_mqa, sparse_latent_mqa

__all__ = ["Expected", "attend", "chunked_prefill", "dcp_latent_mqa", "expected", "indexed_latent_mqa", "latent_mqa",
           "merge_attn_states", "merge_many", "mha_attention", "paged_latent_mqa", "prefill_with_context",
           "ragged_attention", "sparse_latent_mqa"]
