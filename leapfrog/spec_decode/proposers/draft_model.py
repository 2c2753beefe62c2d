"""Draft-model proposer: a smaller model of the same tokenizer, run by our own runtime with its
own KV cache (same row as the request's target row). ``model: "self"`` drafts with the target's
own checkpoint, normally quantized (``draft_quantization``: the quantized self-draft, no extra
files; the embedding is shared with the target).

State per request: ``computed`` = tokens whose draft KV is valid. Each ``propose``
  1. catches up on ``all_ids[computed:]`` (the bonus token, and after a full accept also the
     last draft, which the draft never processed: the "draft-KV gap", STYLE pitfall 15),
  2. drafts k tokens autoregressively, q from the one sampler with the request's params and
     history (drafts included), each token drawn with the request's randomness for that
     position (``Request.rng``).
``on_verified`` rolls the draft back to the accepted prefix: computed = min(computed,
old_len + accepted). Nothing is copied; later writes overwrite the rejected columns.
"""

from __future__ import annotations

import torch

from leapfrog.errors import ConfigError
from leapfrog.model.compiled import make_buckets
from leapfrog.model.loader import load_model, load_tokenizer, read_checkpoint, resolve_dtype
from leapfrog.model.quant import check_quantization
from leapfrog.model.runner import ModelRunner, SeqChunk
from leapfrog.request import Request
from leapfrog.sampling import sampler
from leapfrog.spec_decode.config import SELF_DRAFT, SpeculativeConfig
from leapfrog.spec_decode.draft import DraftBatch, chain_ended, chain_length
from leapfrog.spec_decode.proposers.base import TargetInfo, register_proposer
from leapfrog.spec_decode.verify.result import AcceptanceResult


def check_compatible(target_tok, draft_tok, target_vocab: int, draft_vocab: int, draft_path: str) -> None:
    """Draft and target must speak the same tokens (llama.cpp's vocabulary check)."""
    if draft_vocab != target_vocab:
        raise ConfigError(f"draft model {draft_path}: vocab_size {draft_vocab} != target's {target_vocab}")
    if target_tok is None or draft_tok is None:
        return
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            raise ConfigError(f"draft model {draft_path}: tokenizer {attr} {b!r} != target's {a!r}")
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])[:3]
        raise ConfigError(f"draft model {draft_path}: tokenizer vocabulary differs from the target's "
                          f"({len(dv)} vs {len(tv)} tokens; first differences {diff})")


@register_proposer("draft_model")
class DraftModelProposer:
    def __init__(self, cfg: SpeculativeConfig, target: TargetInfo) -> None:
        self_draft = cfg.model == SELF_DRAFT
        if self_draft and target.checkpoint is None:
            raise ConfigError("speculative_config: model 'self' needs the target's checkpoint")
        ckpt = target.checkpoint if self_draft else read_checkpoint(cfg.model)
        dtype = resolve_dtype(cfg.draft_dtype or target.dtype, ckpt, target.device)
        if not self_draft:
            check_compatible(target.tokenizer, load_tokenizer(ckpt.path) if target.tokenizer is not None else None,
                             target.vocab_size, ckpt.args.vocab_size, str(cfg.model))
        check_quantization(cfg.draft_quantization, dtype, target.device, "speculative_config.draft_quantization")
        # (a dummy target's self-draft draws the target's random weights again, from the same seed)
        dummy = dict(load_format=target.load_format, seed=target.seed) if self_draft else {}
        self.model = load_model(ckpt, dtype, target.device, target.max_model_len, target.allow_pickle, **dummy)
        if cfg.draft_quantization is not None:  # layers and head: q only steers proposals
            self.model.quantize(cfg.draft_quantization, head=True)
        if (self_draft and target.model is not None and target.model.tp is None
                and target.model.embed.weight.dtype == dtype):
            self.model.embed = target.model.embed  # one copy of the shared embedding
        # q only steers proposals (verification uses the target's logits): a half-precision LM
        # head reads half the bytes per draft step (8% more tokens/s for the demo pair).
        self.model.pack_for_inference(fp32_head=False, pack_layers=target.enforce_eager)
        self.runner = ModelRunner(self.model, target.num_rows, target.max_model_len,
                                  batch_invariant=target.batch_invariant)
        self.vocab_size = target.vocab_size
        self.k = cfg.draft_budget  # the most drafts one step asks for (the chain graph's length)
        self.min_confidence = cfg.min_draft_confidence   # greedy chains end below it (draft.chain_length)
        self.chunk = target.max_num_batched_tokens
        self.computed: dict[str, int] = {}
        if target.enforce_eager:
            self._eager_chain()

    def _eager_chain(self) -> None:
        """enforce_eager: greedy chains drafted by one C++ call (model/native_draft.py llama_chain,
        CompiledChain run eagerly) where the draft's layers are on the bf16 few-row kernel; else
        (and for sampled requests) one forward per draft token below."""
        from leapfrog.model.compiled import eager_buckets
        runner = self.runner
        runner.compile_chain(eager_buckets(runner.kv.num_rows, 2, runner.kv.max_model_len), self.k,
                             progress=False, compile=False)
        if self.runner.chain.native_draft is None:
            self.runner.chain = None

    def start(self, req: Request) -> None:
        self.computed[req.request_id] = 0

    def compile(self) -> None:
        """Compiled graphs for draft steps (model/compiled.py): greedy chains of K tokens fused
        in one graph (CompiledChain: the first forward feeds one or two pending tokens, the
        bonus and, after a full accept, the last draft), and one-token steps for sampled
        requests."""
        self.runner.compile_chain(make_buckets(self.runner.kv.num_rows, [2]), self.k)
        self.runner.compile(make_buckets(self.runner.kv.num_rows, [1]))

    def finish(self, req: Request) -> None:
        self.computed.pop(req.request_id, None)

    def propose(self, reqs: list[Request], ks: list[int]) -> DraftBatch:
        active = [b for b, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor | None]] = [[] for _ in reqs]
        if active and self._fused_chains(reqs, active, ks, drafts):
            return DraftBatch.from_lists(drafts)
        self._catch_up([reqs[b] for b in active])
        chunks = []
        for b in active:
            r = reqs[b]
            c = self.computed[r.request_id]
            chunks.append(SeqChunk(r.row, c, r.all_ids[c:], 1))
        step = 0
        path = [0.0] * len(reqs)   # greedy requests' path log confidence (min_confidence)
        while active:
            logits = self.runner.run(chunks)  # [len(active), V]
            specs = [reqs[b].row_spec(drafts[b]) for b in active]
            rows = sampler.build_rows(specs, self.vocab_size)
            if rows.all_greedy:
                tokens = sampler.greedy_tokens(logits, rows)
                q = None
            else:
                q = sampler.probs(logits, rows)
                # seeded requests draw with the noise of the position the target will verify
                # (a coupling: the same noise makes the target's draw likely to match)
                tokens = sampler.sample(q, [reqs[b].rng(len(drafts[b])) for b in active])
            ended = set()
            if self.min_confidence is not None:   # (greedy chains end as draft.chain_length ends them)
                lq = torch.log_softmax(logits.float(), -1).gather(-1, tokens.view(-1, 1).to(logits.device))[:, 0]
                for i, b in enumerate(active):
                    if reqs[b].params.greedy:
                        path[b] += float(lq[i])
                        if chain_ended(path[b], self.min_confidence):
                            ended.add(b)
            for i, b in enumerate(active):
                drafts[b].append(int(tokens[i]))
                qs[b].append(q[i] if q is not None else None)  # None: greedy, a point mass
                r = reqs[b]
                self.computed[r.request_id] = r.num_tokens + step  # tokens fed so far
            step += 1
            active = [b for b in active if len(drafts[b]) < ks[b] and b not in ended]
            chunks = [SeqChunk(reqs[b].row, reqs[b].num_tokens + step - 1, [drafts[b][-1]], 1) for b in active]
        if all(q is None for b in range(len(reqs)) for q in qs[b]):
            return DraftBatch.from_lists(drafts)  # greedy drafts are point masses: q = None
        one_hot = torch.nn.functional.one_hot
        flat_q = [q if q is not None else one_hot(torch.tensor(t), self.vocab_size).float()
                  for b in range(len(reqs)) for q, t in zip(qs[b], drafts[b])]
        return DraftBatch.from_lists(drafts, torch.stack(flat_q))

    def _fused_chains(self, reqs: list[Request], active: list[int], ks: list[int], drafts: list[list[int]]) -> bool:
        """Greedy drafts for every active request from the compiled chain graph (compile), when
        all of them take the plain argmax (no penalties, no min_tokens suppression) -> whether
        it drafted (else nothing was done)."""
        chain = self.runner.chain
        if chain is None or max(ks[b] for b in active) > chain.steps or not all(
                reqs[b].raw_argmax for b in active):
            return False
        rs = [reqs[b] for b in active]
        self._catch_up(rs, keep=chain.max_tokens)
        chunks = [SeqChunk(r.row, self.computed[r.request_id], r.all_ids[self.computed[r.request_id]:], 1) for r in rs]
        # (an eager chain drafts only what this step asks for: a compiled graph runs all its steps)
        out = self.runner.draft_chain(chunks, chain.steps if chain.compiled else max(ks[b] for b in active),
                                      self.min_confidence)
        if out is None:
            return False
        toks, lps = out.tokens.tolist(), out.logprobs.tolist()
        for i, b in enumerate(active):
            n = chain_length(lps[i], ks[b], self.min_confidence)
            drafts[b] = toks[i][:n]
            self.computed[reqs[b].request_id] = reqs[b].num_tokens + n - 1  # tokens fed
        return True

    def _catch_up(self, reqs: list[Request], keep: int = 1) -> None:
        """Compute all but the last ``keep`` pending tokens of each request (long prompts in chunks)."""
        while True:
            chunks = []
            for r in reqs:
                c = self.computed[r.request_id]
                pending = r.num_tokens - keep - c
                if pending > 0:
                    n = min(pending, self.chunk)
                    chunks.append(SeqChunk(r.row, c, r.all_ids[c:c + n], 0))
                    self.computed[r.request_id] = c + n
            if not chunks:
                return
            self.runner.run(chunks)

    @torch.inference_mode()
    def prefill(self, reqs: list[Request]) -> None:
        """The draft's cache over each new prompt (all but the newest token, which every drafting
        path feeds itself), in the target's prefill step (engine: _drafters_prefill)."""
        self._catch_up(reqs, keep=1)

    def round_state(self, reqs: list[Request], k: int) -> tuple[torch.Tensor, ...]:
        """Multi-step speculation's first input (model/compiled.py CompiledSpecRound): each request's
        two newest tokens [n, 2] and the newest one's column [n], after catching the draft's cache
        up to every token before them."""
        self._catch_up(reqs, keep=2)
        return (torch.tensor([r.all_ids[-2:] for r in reqs]), torch.tensor([r.num_tokens - 1 for r in reqs]))

    def after_rounds(self, req: Request, state: tuple[torch.Tensor, ...]) -> None:
        """After multi-step speculation the draft's cache holds every token but the two newest."""
        self.computed[req.request_id] = req.num_tokens - 2

    def on_verified(self, reqs: list[Request], drafts: DraftBatch, result: AcceptanceResult) -> None:
        for r, n_acc in zip(reqs, result.num_accepted):
            if r.request_id in self.computed:
                self.computed[r.request_id] = min(self.computed[r.request_id], r.num_tokens + n_acc)

