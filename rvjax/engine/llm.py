"""Offline API with vLLM's names: `LLM(model).generate(prompts, SamplingParams(...))`.

A `generate` call sorts its requests by prompt length and runs them in static-batch waves sized
to the KV budget: chunked prefill, then decode windows dispatched one ahead of the host reading
the previous window's outbox, so detokenization overlaps device work."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from rvjax.cache import kv as kvcache
from rvjax.engine import runner
from rvjax.engine.loading import load_model
from rvjax.engine.outputs import CompletionOutput, RequestOutput
from rvjax.errors import ConfigError, InvalidRequestError
from rvjax.models import gemma4
from rvjax.sampling import MAX_LOGPROBS, SamplingParams, SamplingTensors

log = logging.getLogger("rvjax")

CPU_MAX_MODEL_LEN = 8192
SPLIT_CACHE_ABOVE = 32 * 1024  # rvLLM §8.2: single-scan up to 32K context, split-cache beyond
GEMMA4_PATHS = ("auto", "single-scan", "split-cache")
LAYER_LOOPS = ("auto", "scan", "unrolled")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine knobs; `LLM(model, **options)` accepts each field by name."""

    max_model_len: int | None = None  # default: the model's context, capped at 8192 on CPU
    dtype: str | None = None  # weights and activations; default float32 on CPU, bfloat16 elsewhere
    tp: int = 1
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64  # largest static batch in one wave
    kv_cache_memory_gib: float = 4.0  # KV budget a wave may reserve
    decode_window: int = 16  # decode steps per device dispatch (Blink's K)
    prefill_chunk: int = 512  # longest prefill chunk; longer prompts are prefilled in chunks
    seed: int = 0  # draws seeds for requests that give none
    # KV layout of models with sliding-window layers (Gemma 3 and 4). single-scan: every layer keeps the
    # whole context. split-cache: sliding layers keep ring buffers of their window, global layers the whole
    # context with blockwise attention, KV int8 by default. auto: split-cache above 32K context.
    gemma4_path: str = "auto"
    layer_loop: str = "auto"  # Gemma 4: lax.scan over layer groups, or unrolled; auto: unrolled on CPU only
    attn_block_k: int = kvcache.DEFAULT_BLOCK_K  # split-cache global attention block


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _install_log_handler() -> None:
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[rvjax] %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


@dataclasses.dataclass
class _Request:
    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    detok: object | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    cumulative: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class LLM:
    def __init__(self, model: str, *, max_model_len: int | None = None, dtype: str | None = None, tp: int = 1,
                 **engine_options):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_options) - fields)
        if unknown:
            raise TypeError(f"LLM got unknown engine option(s) {unknown}; known: {sorted(fields)}")
        self.config = EngineConfig(max_model_len=max_model_len, dtype=dtype, tp=tp, **engine_options)
        if tp != 1:
            raise ConfigError(f"tp={tp}: tensor parallelism is not implemented yet; use tp=1")
        _install_log_handler()
        backend = jax.default_backend()
        dtype_name = dtype or ("float32" if backend == "cpu" else "bfloat16")
        if dtype_name not in DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
        if self.config.gemma4_path not in GEMMA4_PATHS:
            raise ConfigError(f"gemma4_path={self.config.gemma4_path!r} is not one of {list(GEMMA4_PATHS)}")
        if self.config.layer_loop not in LAYER_LOOPS:
            raise ConfigError(f"layer_loop={self.config.layer_loop!r} is not one of {list(LAYER_LOOPS)}")
        if not isinstance(self.config.attn_block_k, int) or self.config.attn_block_k < 1:
            raise ConfigError(f"attn_block_k={self.config.attn_block_k!r} must be a positive integer")
        self.model_cfg, weights, self.tokenizer, info = load_model(model)
        self.weights = jax.tree.map(lambda a: a.astype(DTYPES[dtype_name]), weights)
        self.dtype = dtype_name
        limit = self.model_cfg.max_position
        if backend == "cpu":
            limit = min(limit, CPU_MAX_MODEL_LEN)
        self.max_model_len = limit if max_model_len is None else max_model_len
        if not isinstance(self.max_model_len, int) or not 1 < self.max_model_len <= self.model_cfg.max_position:
            raise ConfigError(f"max_model_len={max_model_len} must be in [2, {self.model_cfg.max_position}] "
                             f"(the model's context)")
        self.path = self._resolve_path()
        self.kv_dtype = kvcache.resolve_kv_dtype(self.config.kv_cache_dtype, backend, self.split)
        self.layer_loop = self._resolve_loop(backend)
        if self.model_cfg.family == "gemma4":
            self.weights = gemma4.to_layout(self.weights, self.model_cfg, self.layer_loop == "scan")
        # Split-cache: ring buffers cost a fixed amount per sequence; everything else grows with its length.
        per_token = kvcache.cache_bytes(self.model_cfg, 1, 1, self.kv_dtype)
        self._bytes_per_token = per_token["global"] + (0 if self.split else per_token["sliding"])
        self._bytes_per_row = kvcache.cache_bytes(self.model_cfg, 1, self.model_cfg.sliding_window or 1,
                                                  self.kv_dtype, split=True)["sliding"] if self.split else 0
        budget = self.config.kv_cache_memory_gib * 2**30
        if self._wave_bytes(1, self.max_model_len) > budget:
            raise ConfigError(f"kv_cache_memory_gib={self.config.kv_cache_memory_gib} cannot hold one sequence of "
                             f"max_model_len={self.max_model_len}; raise it or lower max_model_len")
        self._rng = np.random.default_rng(self.config.seed)
        self.load_info = info
        log.info("%s: %s, %d layers, weights %s on %s; loaded in %.1f s (%s)", model, self.model_cfg.family,
                 self.model_cfg.num_layers, dtype_name, backend, info["load_seconds"],
                 "conversion cache" if info["conversion_cache_hit"] else info["source"])
        log.info("max_model_len=%d; %s, layer loop %s; KV cache %s, %d B/token%s, budget %.2f GiB",
                 self.max_model_len, self.path, self.layer_loop, self.kv_dtype, self._bytes_per_token,
                 f" + {self._bytes_per_row} B/sequence of ring buffers" if self.split else "", budget / 2**30)

    @property
    def split(self) -> bool:
        return self.path == "split-cache"

    def _resolve_path(self) -> str:
        """single-scan or split-cache (rvLLM §8.2); split-cache needs sliding-window layers."""
        cfg, asked = self.model_cfg, self.config.gemma4_path
        has_sliding = any(cfg.is_sliding(i) for i in range(cfg.num_layers))
        if asked == "auto":
            return "split-cache" if has_sliding and self.max_model_len > SPLIT_CACHE_ABOVE else "single-scan"
        if asked == "split-cache" and not has_sliding:
            raise ConfigError(f"gemma4_path='split-cache' needs sliding-window layers; {cfg.family} has none")
        return asked

    def _resolve_loop(self, backend: str) -> str:
        """Gemma 4's layer loop: a scan over layer groups compiles once per group and is free on TPU, but
        XLA:CPU copies each scanned weight slice (a decode step 4.6x slower here:
        bench/results/gemma4_layer_loop_cpu.md), so auto unrolls on CPU."""
        asked = self.config.layer_loop
        if self.model_cfg.family != "gemma4":
            if asked == "scan":
                raise ConfigError(f"layer_loop='scan' is implemented for Gemma 4, not {self.model_cfg.family}")
            return "unrolled"
        if asked == "auto":
            return "unrolled" if backend == "cpu" else "scan"
        return asked

    def _wave_bytes(self, rows: int, cache_len: int) -> int:
        length = kvcache.global_len(cache_len, self.config.attn_block_k) if self.split else cache_len
        return int(rows * (self._bytes_per_token * length + self._bytes_per_row))

    def _new_cache(self, rows: int, cache_len: int):
        kw = dict(split=self.split, block_k=self.config.attn_block_k)
        if self.model_cfg.family == "gemma4":
            return gemma4.new_cache(self.model_cfg, self.weights, rows, cache_len, self.kv_dtype, **kw)
        return kvcache.new_cache(self.model_cfg, rows, cache_len, self.kv_dtype, **kw)

    # ---- tokenization -------------------------------------------------------------------------------

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise InvalidRequestError(f"{what} needs a tokenizer, and this model has none; pass prompt_token_ids")
        return self.tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._need_tokenizer("tokenize").encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._need_tokenizer("detokenize").decode(list(ids))

    # ---- generation ---------------------------------------------------------------------------------

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = True,
                 add_special_tokens: bool = True) -> list[RequestOutput]:
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            tok = self._need_tokenizer("a text prompt")
            for i, p in enumerate(prompts):
                if not isinstance(p, str) or not p:
                    raise InvalidRequestError(f"prompt {i} is empty or not a string: {p!r}")
            ids = [tok.encode(p, add_special_tokens=add_special_tokens) for p in prompts]
        else:
            ids = [list(map(int, p)) for p in prompt_token_ids]
            prompts = [None] * len(ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(ids) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(ids):
            raise InvalidRequestError(f"{len(params)} sampling params for {len(ids)} prompts")
        reqs = [self._make_request(i, p, x, sp) for i, (p, x, sp) in enumerate(zip(prompts, ids, params))]
        bar = tqdm(total=len(reqs), desc="generating", unit="req", disable=not use_tqdm or len(reqs) < 2)
        for wave in self._waves(reqs):
            self._run_wave(wave)
            bar.update(len(wave))
        bar.close()
        return [self._result(r) for r in reqs]

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True, add_generation_prompt: bool = True, **template_kwargs) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        tok = self._need_tokenizer("chat")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs or any(not c for c in convs):
            raise InvalidRequestError("chat needs at least one non-empty conversation")
        texts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt, **template_kwargs)
                 for c in convs]
        # The template already writes BOS and the turn markers.
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm, add_special_tokens=False)

    def _make_request(self, index, prompt, ids, params: SamplingParams) -> _Request:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params[{index}] is {type(params).__name__}, not SamplingParams")
        params.validate()
        if not ids:
            raise InvalidRequestError(f"prompt {index} is empty")
        bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt {index} has token id {bad[0]} outside [0, {self.model_cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt {index} has {len(ids)} tokens; max_model_len={self.max_model_len} "
                                      "leaves no room to generate")
        detok = None
        if self.tokenizer is not None:
            from rvjax.tokenizer import IncrementalDetokenizer
            detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
        return _Request(index, prompt, ids, params, detok)

    def _need(self, r: _Request) -> int:
        return min(len(r.prompt_ids) + r.params.max_tokens, self.max_model_len)

    def _waves(self, reqs: list[_Request]):
        """Longest prompts first, in waves within max_num_seqs and the KV budget."""
        budget = self.config.kv_cache_memory_gib * 2**30
        wave: list[_Request] = []
        need = 0
        for r in sorted(reqs, key=lambda r: -len(r.prompt_ids)):
            # Prompts come longest first, so a wave's prefill shape is set by its first request.
            longest = len((wave or [r])[0].prompt_ids)
            trial_need = max(need, self._need(r))
            too_big = self._wave_bytes(_pow2(len(wave) + 1), self._cache_len(longest, trial_need)) > budget
            if wave and (len(wave) + 1 > self.config.max_num_seqs or too_big):
                yield wave
                wave, trial_need = [], self._need(r)
            wave.append(r)
            need = trial_need
        if wave:
            yield wave

    def _prefill_shape(self, longest: int) -> tuple[int, int]:
        """(chunk length, number of chunks) covering a prompt of `longest` tokens."""
        chunk = min(_pow2(longest, 16), self.config.prefill_chunk)
        return chunk, math.ceil(longest / chunk)

    def _cache_len(self, longest: int, need: int) -> int:
        """Cache positions for a wave: its largest prompt + max_tokens (`need`), bucketed, and at least the
        padded prefill of its longest prompt (chunk writes must stay inside the buffer)."""
        chunk, n = self._prefill_shape(longest)
        return max(_pow2(need, 128), chunk * n)

    def _wave_cache_len(self, wave: list[_Request]) -> int:
        return self._cache_len(max(len(r.prompt_ids) for r in wave), max(self._need(r) for r in wave))

    def _pad_prompts(self, wave, rows: int):
        """Prompts right-padded to whole prefill chunks: (tokens [rows, n*chunk], lengths [rows], chunk, n)."""
        chunk, n_chunks = self._prefill_shape(max(len(r.prompt_ids) for r in wave))
        tokens = np.zeros((rows, chunk * n_chunks), np.int32)
        lengths = np.ones((rows,), np.int32)
        for i, r in enumerate(wave):
            tokens[i, : len(r.prompt_ids)] = r.prompt_ids
            lengths[i] = len(r.prompt_ids)
        return tokens, lengths, chunk, n_chunks

    def _run_wave(self, wave: list[_Request]) -> None:
        cfg, k = self.model_cfg, self.config.decode_window
        rows = _pow2(len(wave))
        cache = self._new_cache(rows, self._wave_cache_len(wave))
        state = self._initial_state(wave, rows)
        tokens, lengths, chunk, n_chunks = self._pad_prompts(wave, rows)
        last_h = jnp.zeros((rows, cfg.hidden_size), DTYPES[self.dtype])
        lengths_dev = jnp.asarray(lengths)
        for c in range(n_chunks):
            last_h, cache = runner.prefill_chunk(self.weights, cfg, jnp.asarray(tokens[:, c * chunk:(c + 1) * chunk]),
                                                 c * chunk, lengths_dev, cache, last_h)
        n_lp = self._num_logprobs(wave)
        state, first = runner.first_token(self.weights, cfg, last_h, state, self.max_model_len, n_lp)
        first = jax.device_get(first)
        self._absorb(wave, *(x[:, None] for x in first))
        # A window is dispatched before the previous one's outbox is read (JAX async dispatch).
        pending = None
        while any(r.finish_reason is None for r in wave):
            state, cache, out = runner.decode_window(self.weights, cfg, state, cache, k, n_lp)
            if pending is not None:
                state = self._drain(wave, pending, state)
            pending = out
        del cache

    def _drain(self, wave, out: runner.Outbox, state):
        """Read one outbox into the requests; tell the device about stop strings the host matched."""
        out = jax.device_get(out)
        stopped_by_host = self._absorb(wave, out.tokens, out.logprobs, out.top_ids, out.top_logprobs)
        for i, r in enumerate(wave):
            if r.finish_reason is None and out.done[i]:
                last = r.token_ids[-1]
                if last in self._stop_ids(r.params):
                    r.finish_reason, r.stop_reason = "stop", last
                else:
                    r.finish_reason = "length"
        if stopped_by_host:
            mask = np.zeros(out.done.shape, bool)
            mask[stopped_by_host] = True
            state = runner.finish_rows(state, jnp.asarray(mask))
        return state

    def _absorb(self, wave, tokens, logprobs, top_ids, top_lps) -> list[int]:
        """Append a window's tokens [B, K] to the requests; returns rows a stop string finished."""
        stopped = []
        for i, r in enumerate(wave):
            for j in range(tokens.shape[1]):
                t = int(tokens[i, j])
                if t < 0 or r.finish_reason is not None:
                    continue
                r.token_ids.append(t)
                r.cumulative += float(logprobs[i, j])
                if r.params.logprobs is not None:
                    d = {int(a): float(b) for a, b in zip(top_ids[i, j, : r.params.logprobs], top_lps[i, j])}
                    d[t] = float(logprobs[i, j])
                    r.logprobs.append(d)
                if r.detok is not None:
                    before = len(r.text)
                    r.text += r.detok.push(t)
                    if r.params.stop and self._match_stop(r, before):
                        stopped.append(i)
        return stopped

    def _match_stop(self, r: _Request, before: int) -> bool:
        """Cut r.text at the first stop string that the new text completes (the stop string is not kept)."""
        longest = max(map(len, r.params.stop))
        start = max(0, before - longest + 1)
        hits = [(r.text.find(s, start), s) for s in r.params.stop]
        hits = [(p, s) for p, s in hits if p >= 0]
        if not hits:
            return False
        pos, s = min(hits)
        r.text = r.text[:pos]
        r.finish_reason, r.stop_reason = "stop", s
        return True

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer is not None:
            ids |= set(self.tokenizer.stop_ids)
        return ids

    def _num_logprobs(self, wave) -> int:
        n = max((r.params.logprobs or 0) for r in wave)
        return 0 if n == 0 else MAX_LOGPROBS if n > 5 else 5

    def _initial_state(self, wave: list[_Request], rows: int) -> runner.DecodeState:
        vocab = self.model_cfg.vocab_size
        stops = [sorted(self._stop_ids(r.params)) for r in wave]
        m = _pow2(max([len(s) for s in stops] + [1]))
        stop_ids = np.full((rows, m), -1, np.int32)
        prompt_mask = np.zeros((rows, vocab), bool)
        pos = np.zeros(rows, np.int32)
        max_tokens = np.ones(rows, np.int32)
        done = np.ones(rows, bool)
        for i, r in enumerate(wave):
            stop_ids[i, : len(stops[i])] = stops[i]
            prompt_mask[i, r.prompt_ids] = True
            pos[i] = len(r.prompt_ids) - 1
            max_tokens[i] = r.params.max_tokens
            done[i] = False
        return runner.DecodeState(
            tokens=jnp.zeros(rows, jnp.int32), pos=jnp.asarray(pos), generated=jnp.zeros(rows, jnp.int32),
            max_tokens=jnp.asarray(max_tokens), done=jnp.asarray(done), stop_ids=jnp.asarray(stop_ids),
            counts=jnp.zeros((rows, vocab), jnp.int32), prompt_mask=jnp.asarray(prompt_mask),
            sampling=SamplingTensors.from_params([r.params for r in wave], rows, self._rng))

    def _result(self, r: _Request) -> RequestOutput:
        text = None
        if r.detok is not None:
            if r.stop_reason is None or not isinstance(r.stop_reason, str):
                r.text += r.detok.flush()
            text = r.text
        out = CompletionOutput(0, text, r.token_ids, r.finish_reason, r.stop_reason, r.cumulative,
                               r.logprobs if r.params.logprobs is not None else None)
        return RequestOutput(str(r.index), r.prompt, r.prompt_ids, [out])

    # ---- evaluation ---------------------------------------------------------------------------------

    def logits(self, prompt_token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Float32 logits [B, T, V] for every position; rows shorter than the longest are NaN-padded."""
        seqs = [list(map(int, s)) for s in prompt_token_ids]
        if not seqs or any(not s for s in seqs):
            raise InvalidRequestError("logits needs non-empty token id lists")
        reqs = [self._make_request(i, None, s, SamplingParams(max_tokens=1)) for i, s in enumerate(seqs)]
        longest = max(len(s) for s in seqs)
        out = np.full((len(seqs), longest, self.model_cfg.vocab_size), np.nan, np.float32)
        for wave in self._waves(reqs):
            rows = _pow2(len(wave))
            cache = self._new_cache(rows, self._wave_cache_len(wave))
            tokens, lengths, chunk, n_chunks = self._pad_prompts(wave, rows)
            lengths = jnp.asarray(lengths)
            for c in range(n_chunks):
                lg, cache = runner.chunk_logits(self.weights, self.model_cfg,
                                                jnp.asarray(tokens[:, c * chunk:(c + 1) * chunk]), c * chunk, lengths,
                                                cache)
                lg = np.asarray(lg)
                for i, r in enumerate(wave):
                    n = min(len(r.prompt_ids) - c * chunk, chunk)
                    if n > 0:
                        out[r.index, c * chunk: c * chunk + n] = lg[i, :n]
        return out
