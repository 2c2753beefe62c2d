"""Which slice of each tensor a tensor-parallel rank holds (Megatron-style): pure functions.

With N ranks, rank r holds
- query heads ``[r H/N, (r+1) H/N)``; KV heads ``[r KV/N, (r+1) KV/N)`` when N divides KV, else
  (KV < N, N a multiple of KV) the one KV head its query heads read, replicated on N/KV ranks
  (vLLM's rule);
- the MLP's intermediate channels ``[r I/N, (r+1) I/N)`` (gate and up rows, down columns);
- vocabulary rows ``[r Vp/N, (r+1) Vp/N)`` of the embedding and the LM head, with the vocabulary
  padded to Vp, the next multiple of N (padding rows are zero; their logits are cut off).

Column-parallel (output rows split): fused q/k/v, fused gate/up, LM head. Row-parallel (input
columns split, partial sums all-reduced): o_proj, down_proj. Norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from leapfrog.errors import ConfigError
from leapfrog.model.args import LlamaArgs


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    args: LlamaArgs        # the whole model's

    def _mine(self, per_rank: int) -> range:
        """This rank's ``per_rank`` consecutive items of a dimension split evenly over the ranks."""
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def heads(self) -> range:
        return self._mine(self.args.num_attention_heads // self.size)

    @property
    def kv_heads(self) -> range:
        kv = self.args.num_key_value_heads
        if kv >= self.size:
            return self._mine(kv // self.size)
        first = self.rank * kv // self.size   # the head this rank's query heads read
        return range(first, first + 1)

    @property
    def intermediate(self) -> range:
        return self._mine(self.args.intermediate_size // self.size)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.args.vocab_size // self.size)

    @property
    def vocab(self) -> range:
        """Vocabulary rows held, padding included (ids >= vocab_size are padding)."""
        return self._mine(self.vocab_per_rank)

    def local_args(self) -> LlamaArgs:
        """The shapes of this rank's layers: its heads, KV heads, intermediate channels and vocab rows."""
        a = self.args
        return replace(a, num_attention_heads=len(self.heads), num_key_value_heads=len(self.kv_heads),
                       intermediate_size=len(self.intermediate), vocab_size=self.vocab_per_rank)

    def rows(self, r: range, width: int) -> tuple[int, int]:
        """Range of heads (or channels, width 1) -> row range of a [heads * width, ...] tensor."""
        return r.start * width, r.stop * width


def check_divisible(args: LlamaArgs, size: int) -> None:
    """Refuse a tensor-parallel size the model's shapes cannot be split into, naming the field."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    h, kv, inter = args.num_attention_heads, args.num_key_value_heads, args.intermediate_size
    problems = []
    if h % size:
        problems.append(f"num_attention_heads={h} is not divisible by {size}")
    if kv >= size and kv % size:
        problems.append(f"num_key_value_heads={kv} is not divisible by {size}")
    if kv < size and size % kv:
        problems.append(f"{size} is not a multiple of num_key_value_heads={kv} (KV heads are replicated "
                        "when there are fewer than ranks)")
    if inter % size:
        problems.append(f"intermediate_size={inter} is not divisible by {size}")
    if problems:
        raise ConfigError(f"tensor_parallel_size={size} does not fit the model: " + "; ".join(problems))
