"""Generation throughput: fusedrl engine (eager, compiled, int8) vs torchtune's or transformers' ``generate``.

    python -m fusedrl.bench.generation [--json] [--quantize] [--new-tokens N] [--batch-sizes 1,8,32]
    python -m fusedrl.bench.generation --model models/SmolLM2-135M-Instruct --batch-sizes 1,16 --json
    python -m fusedrl.bench.generation --device cuda --flavor llama3_2_1b --dtype bfloat16 \
        --compile-scope step --compile-mode reduce-overhead --batch-sizes 1,8,32,128 --json     # on a GPU

Same model, same prompts (random ids, one length), same number of new tokens per request (forced: no stop tokens);
on CPU ``--threads`` threads (``torch.set_num_threads``). ``--flavor`` (``debug_large`` by default): random weights,
sampling at temperature 1, against torchtune's ``generate``. ``--model FOLDER``: a real HF checkpoint, greedy
decoding, against transformers' ``generate`` on the same folder loaded by transformers (same dtype, batched, no
padding), and the greedy tokens of every row are compared (rows whose tokens differ from transformers' are counted:
float rounding can flip a near tie). Tokens/s counts generated tokens over wall time including prefill; compile time
is excluded (a warm-up generation precedes the timed ones) and reported separately. Modes are timed interleaved,
``--repeats`` times each, and the best time per mode counts. Every mode but the compiled one is timed first, for every
batch size; then the compiled engine, interleaved with the baseline and the eager engine again (their figures of that
batch size replaced, so that all come from one pass), one batch size at a time while ``--time-budget-s`` lasts (counted
from the model's load): whatever compiling costs, a run cut at its limit has the other figures (with ``--json``, a
partial JSON line after each batch size of each pass and each batch size left out).

On a device where the engine reads each decode step's tokens one step late by default (CUDA:
``fusedrl.generation.slots.reads_lag_a_step``), the eager engine that reads every step at once is timed beside it
(``eager_reads_each_step``): what the late read gains.

Prefill sharing (``--prefill-groups 4,8,16``): the eager engine's prefill (and one sampled token) of 16 prompts, all
distinct, against 16 / n distinct prompts of n samples each, which the engine prefills once per prompt.

Compilation: each compiled engine's graphs and the time of the calls that compiled them (``engine.compile_stats``);
then a compiled engine with the default batch and length buckets of ``--graphs-slots`` slots and a
``--graphs-max-len`` cache (the debug configs' 16 and 160 by default) generates a mix of prompt and response lengths
that visits every batch bucket and several length buckets, and its graph count and compile time are printed: what
a training job's engine compiles.

Each figure is also given as a fraction of the memory-bandwidth roofline of decoding: a decode step must read every
weight and the batch's KV cache once, so ``roofline tok/s = batch / ((weight bytes + batch x mean context x KV
bytes per token) / --hbm-bytes-per-s)`` (default on a GPU the data sheet's HBM bandwidth of the device found, e.g.
3.35e12 B/s on an H100 SXM, 4.8e12 on an H200, else its measured read bandwidth; on the CPU this machine's read
bandwidth at ``--threads``; measured once by ``fusedrl.hardware.cached_peak``).

``--compile-scope`` (``layer`` by default) is the compiled engine's ``compile_scope``.

Speculative decoding (``--speculative``, with ``--model``): the engine with ``speculative = "history"`` against
without, eager, on the reasoning task's word problems (``fusedrl.tasks.word_problems``, chat-rendered) sampled at
temperature 1 in groups of 4 samples per problem as a GRPO rollout decodes them (a batch of 1: one sample), up to
``--new-tokens`` tokens, interleaved, best of ``--repeats`` (each round with another seed, as iterations sample
anew; the drafter keeps the earlier rounds' responses as history): tokens/s both ways, the ratio, the verify steps'
accepted share and tokens per step, and how many samples came out identical (the samples must be; in bf16 a near
tie can flip between a multi-position and a one-position forward). The engine speculates at its default
``speculative_rows``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable

import torch
from torchtune.generation import generate as torchtune_generate
from torchtune.modules import TransformerDecoder

from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.generation.engine import CompileScope
from fusedrl.generation.slots import reads_lag_a_step
from fusedrl.hardware import accelerator_named, cached_peak
from fusedrl.models import ModelFlavor, build_model, from_pretrained, resolve_flavor
from fusedrl.models.figures import kv_bytes_per_token


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, prompt_len), generator=g).to(device)


def _torchtune_runner(model, prompts: torch.Tensor, new_tokens: int):
    model = copy.deepcopy(model)  # torchtune caches are fixed to one batch size once set up
    dtype = model.tok_embeddings.weight.dtype
    with prompts.device:  # torchtune makes its caches on the default device
        model.setup_caches(batch_size=prompts.shape[0], dtype=dtype, decoder_max_seq_len=prompts.shape[1] + new_tokens)
    rng = torch.Generator(device=prompts.device).manual_seed(0)

    def run():
        model.reset_caches()
        tokens, _ = torchtune_generate(model, prompts, max_generated_tokens=new_tokens, temperature=1.0, rng=rng)
        assert tokens.shape[1] == prompts.shape[1] + new_tokens

    return run


def _transformers_runner(model, prompts: torch.Tensor, new_tokens: int, out: dict):
    """transformers' greedy ``generate`` of exactly ``new_tokens`` per row (no stop token); ``out["tokens"]``: the rows."""
    model.generation_config.eos_token_id = None  # decode to the limit, as the engine does without stop tokens
    mask = torch.ones_like(prompts)

    def run():
        tokens = model.generate(
            prompts, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0, use_cache=True
        )
        assert tokens.shape[1] == prompts.shape[1] + new_tokens
        out["tokens"] = tokens[:, prompts.shape[1] :].tolist()

    return run


def _engine_runner(engine: GenerationEngine, prompts: torch.Tensor, new_tokens: int, greedy: bool = False, out=None):
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens) if greedy else SamplingParams(target_len=new_tokens)
    calls = iter(range(1 << 30))

    def run():
        call = next(calls)
        reqs = [Request(i, p.tolist(), params, seed=call) for i, p in enumerate(prompts)]
        results = sorted(engine.generate(reqs, progress=False), key=lambda r: r.id)
        assert all(len(r.tokens) == new_tokens for r in results), "engine produced the wrong number of tokens"
        if out is not None:
            out["tokens"] = [r.tokens for r in results]

    return run


def bucketed_compile(model: TransformerDecoder, slots: int, max_len: int, scope: CompileScope) -> dict[str, float]:
    """Graphs and compile seconds of a compiled engine with default buckets over a mixed-length generation: 3x
    ``slots`` requests, prompts of 4 to max_len / 3 tokens, responses of 1 to the rest (a long tail: the batch
    shrinks through every batch bucket at the end)."""
    engine = GenerationEngine(model, max_slots=slots, max_len=max_len, compile=True, compile_scope=scope)
    g = torch.Generator().manual_seed(0)
    vocab = model.tok_embeddings.num_embeddings
    requests = []
    for i in range(3 * slots):
        prompt_len = int(torch.randint(4, max_len // 3 + 1, (), generator=g))
        target = 1 + int((max_len - prompt_len - 1) * (i / (3 * slots - 1)) ** 3)
        prompt = torch.randint(1, vocab, (prompt_len,), generator=g).tolist()
        requests.append(Request(i, prompt, SamplingParams(target_len=target), seed=i))
    start = time.perf_counter()
    engine.generate(requests, progress=False)
    return {
        "graphs": engine.compile_stats.graphs,
        "compile_s": engine.compile_stats.seconds,
        "wall_s": time.perf_counter() - start,
        "batch_buckets": len(engine.batch_buckets),
        "len_buckets": len(engine.len_buckets),
    }


def prefill_sharing(
    model: TransformerDecoder, requests: int, prompt_len: int, groups: list[int], repeats: int, device: str
) -> dict[str, dict[str, float]]:
    """Seconds of the eager engine's prefill (and one sampled token) of ``requests`` prompts of ``prompt_len`` tokens:
    all distinct, against ``requests / n`` distinct prompts of ``n`` samples each (a GRPO group, which the engine
    prefills once), per ``n`` in ``groups``; the two interleaved, best of ``repeats``."""
    vocab = model.tok_embeddings.num_embeddings
    engine = GenerationEngine(model, max_slots=requests, max_len=prompt_len + 1)
    params = SamplingParams(max_new_tokens=1)
    distinct = _prompts(requests, prompt_len, vocab, seed=1, device="cpu").tolist()
    calls = iter(range(1 << 30))

    def run(prompts: list[list[int]]) -> float:
        call = next(calls)
        reqs = [Request(f"{call}/{i}", p, params, seed=i) for i, p in enumerate(prompts)]
        return _seconds(lambda: engine.generate(reqs, progress=False))

    run(distinct)  # warm-up
    out = {}
    for n in groups:
        shared = [distinct[i // n] for i in range(requests)]
        best = {"distinct_s": float("inf"), "shared_s": float("inf")}
        with torch.no_grad():
            for _ in range(repeats):
                best["distinct_s"] = min(best["distinct_s"], run(distinct))
                best["shared_s"] = min(best["shared_s"], run(shared))
        out[str(n)] = best
    return out


def speculative_figures(model: TransformerDecoder, folder: str, batch_sizes: list[int], new_tokens: int, repeats: int) -> dict:
    """Tokens/s of the eager engine with and without ``speculative = "history"`` (module docstring), per batch size."""
    from fusedrl.components import HFTokenizer, load_tokenizer
    from fusedrl.tasks.word_problems import sample_problems

    tok = load_tokenizer(folder)
    if not isinstance(tok, HFTokenizer):
        raise ValueError(f"--speculative renders chat prompts: {folder} needs a tokenizer.json with a chat template")
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=tuple(tok.stop_token_ids))
    problems = [q for _, q, _ in sample_problems(max(batch_sizes), seed=0, difficulties=(1, 2))]
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": q}]), add_bos=False) for q in problems]
    max_len = max(len(p) for p in prompts) + new_tokens + 1
    out: dict = {}
    print(
        f"speculative decoding (history drafts), {folder}: word problems, groups of 4, temperature 1, up to {new_tokens} tokens"
    )
    print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'accepted':>9} {'tokens/verify':>14}  same samples")
    for b in batch_sizes:
        group = min(4, b)
        requests = [Request(i, prompts[i // group], params, seed=1) for i in range(b)]
        engines = {
            "off": GenerationEngine(model, max_slots=b, max_len=max_len),
            "on": GenerationEngine(model, max_slots=b, max_len=max_len, speculative="history"),  # its default rows
        }
        results: dict[str, list] = {}
        rates = dict.fromkeys(engines, 0.0)
        with torch.no_grad():
            for round_ in range(repeats + 1):  # the first warms up; each samples anew (an iteration of a rollout)
                for name, engine in engines.items():
                    reqs = [Request(r.id, r.prompt, r.sampling, seed=round_) for r in requests]
                    start = time.perf_counter()
                    res = engine.generate(reqs, progress=False)
                    seconds = time.perf_counter() - start
                    if round_:
                        rates[name] = max(rates[name], sum(len(r.tokens) for r in res) / seconds)
                    results[name] = res
        assert engines["on"].speculator is not None  # speculative="history"
        spec = engines["on"].speculator.take_figures()
        same = sum(a.tokens == b_.tokens for a, b_ in zip(results["off"], results["on"]))
        accepted = spec.get("accepted", 0) / max(spec.get("drafted", 0), 1)
        per_verify = spec["produced"] / max(spec["verify_steps"], 1)
        out[str(b)] = {"tokens_per_s": rates, "ratio": rates["on"] / rates["off"], "accepted": accepted, "same": same}
        print(
            f"{b:>5} {rates['off']:>10.1f} {rates['on']:>10.1f} {rates['on'] / rates['off']:>6.2f}x {accepted:>9.0%} "
            f"{per_verify:>14.2f}  {same}/{b}"
        )
    return out


def _seconds(run) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def roofline_tokens_per_s(
    model: TransformerDecoder, flavor: ModelFlavor, batch: int, prompt_len: int, new_tokens: int, bytes_per_s: float
) -> float:
    """Decode tokens/s if every step read all weights and the batch's KV cache at ``bytes_per_s``."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = kv_bytes_per_token(flavor, model.tok_embeddings.weight.element_size())
    mean_context = prompt_len + new_tokens / 2
    return batch / ((weights + batch * mean_context * kv_per_token) / bytes_per_s)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--json",
        action="store_true",
        help='print the figures as one JSON object as the last line (and, as each batch size ends, those so far with "partial": true)',
    )
    p.add_argument("--flavor", default="debug_large", help="random weights of this flavor (without --model)")
    p.add_argument("--model", default=None, help="an HF checkpoint folder: greedy decoding against transformers' generate")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per mode (interleaved); the best counts")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled mode")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=0.0,
        help="the compiled mode (timed after every other mode's figures) starts a batch size only within this many "
        "seconds of the start (0: no limit); the batch sizes left out are listed in compiled_skipped",
    )
    p.add_argument("--quantize", action="store_true", help="also run the int8 weight-only engine")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument(
        "--compile-mode",
        default="default",
        choices=("default", "reduce-overhead", "max-autotune"),
        help="torch.compile mode of the compiled engine (reduce-overhead: CUDA graphs)",
    )
    p.add_argument(
        "--compile-scope",
        default="layer",
        choices=("layer", "step"),
        help="what the compiled engine compiles: one layer's decode reused by every layer, or the whole step",
    )
    p.add_argument(
        "--prefill-groups",
        default="4,8,16",
        help="samples per prompt of the prefill-sharing figures (16 requests; empty: skip them)",
    )
    p.add_argument("--speculative", action="store_true", help="with --model: speculative decoding on vs off, and nothing else")
    p.add_argument("--graphs-slots", type=int, default=16, help="slots of the bucketed compile run (0: skip it)")
    p.add_argument("--graphs-max-len", type=int, default=160, help="cache length of the bucketed compile run")
    p.add_argument(
        "--hbm-bytes-per-s",
        type=float,
        default=None,
        help="memory bandwidth of the roofline (default: the GPU's data sheet, else its measured read bandwidth; the CPU's measured one)",
    )
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.hbm_bytes_per_s is not None:
        bandwidth = args.hbm_bytes_per_s
    elif args.device == "cuda":
        sheet = accelerator_named(torch.cuda.get_device_name())
        bandwidth = sheet.hbm_bytes_per_s if sheet else cached_peak("cuda").memory_read_bytes_per_s
        print(f"roofline bandwidth: {bandwidth / 1e12:.2f} TB/s ({sheet.name if sheet else 'measured'})", flush=True)
    else:
        bandwidth = cached_peak("cpu", args.threads).memory_read_bytes_per_s
    dtype = getattr(torch, args.dtype)
    hf_model = None
    if args.model:
        import transformers

        loaded, flavor = from_pretrained(args.model, dtype=dtype, device=args.device)
        model = loaded.eval()
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
        label, baseline = args.model, "transformers"
    else:
        flavor = resolve_flavor(args.flavor)
        model = build_model(flavor).to(device=args.device, dtype=dtype).eval()
        label, baseline = args.flavor, "torchtune"
    vocab = flavor.vocab_size
    max_len = args.prompt_len + args.new_tokens
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.speculative:
        if not args.model:
            p.error("--speculative decodes a real model's text: give --model FOLDER")
        figures = {"speculative": speculative_figures(model, args.model, batch_sizes, args.new_tokens, args.repeats)}
        if args.json:
            print(json.dumps(figures))
        return figures
    greedy = hf_model is not None

    modes: dict[str, dict[str, float]] = {baseline: {}, "eager": {}}
    if reads_lag_a_step(torch.device(args.device)):
        modes["eager_reads_each_step"] = {}
    if not args.no_compile:
        modes["compiled"] = {}
    if args.quantize:
        modes["int8_eager"] = {}
    compile_s: dict[str, float] = {}
    graphs: dict[str, dict[str, float]] = {}
    sampling = "greedy" if greedy else "temperature 1"
    print(
        f"{label}: prompt {args.prompt_len} + {args.new_tokens} new tokens, {sampling}, {args.threads} thread(s); "
        f"roofline at {bandwidth / 1e9:.0f} GB/s"
    )
    print(f"{'batch':>5} " + " ".join(f"{m + ' tok/s':>16}" for m in modes) + f" {'best/' + baseline:>18}")
    speedup: dict[str, float] = {}
    roofline: dict[str, dict[str, float]] = {}
    differing_rows: dict[str, int] = {}
    out = {  # filled as each batch size ends: with --json a partial copy is printed then (a killed run keeps them)
        f"speedup_vs_{baseline}": speedup,
        "modes": modes,
        "greedy_rows_differing": differing_rows,
        "compile_overhead_s": compile_s,
        "compiled_graphs": graphs,
        "bucketed_compile": {},
        "prefill_sharing": {},
        "roofline_fraction": roofline,
        "model": label,
        "device": args.device,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
    }
    deadline = None if args.time_budget_s <= 0 else time.monotonic() + args.time_budget_s
    skipped: list[str] = []
    out["compiled_skipped"] = skipped

    def measure(b: int, names: list[str]) -> None:
        """Time ``names`` at batch size ``b`` (interleaved repeats, the best counts) and report the batch's figures."""
        prompts = _prompts(b, args.prompt_len, vocab, seed=b, device=args.device)
        tokens = b * args.new_tokens
        theirs: dict = {}
        ours: dict = {}
        runners: dict[str, Callable[[], object]] = {}
        if baseline in names:
            runners[baseline] = (
                _transformers_runner(hf_model, prompts, args.new_tokens, theirs)
                if hf_model is not None
                else _torchtune_runner(model, prompts, args.new_tokens)
            )
        if "eager" in names:
            runners["eager"] = _engine_runner(
                GenerationEngine(model, max_slots=b, max_len=max_len), prompts, args.new_tokens, greedy, ours
            )
        if "eager_reads_each_step" in names:
            engine = GenerationEngine(model, max_slots=b, max_len=max_len, lagged_reads=False)
            runners["eager_reads_each_step"] = _engine_runner(engine, prompts, args.new_tokens, greedy)
        compiled = None
        if "compiled" in names:
            # One length bucket (as the figures before the symbolic attended length were measured).
            mode = None if args.compile_mode == "default" else args.compile_mode
            compiled = GenerationEngine(
                model,
                max_slots=b,
                max_len=max_len,
                compile=True,
                compile_scope=args.compile_scope,
                mode=mode,
                len_buckets=[max_len],
            )
            runners["compiled"] = _engine_runner(compiled, prompts, args.new_tokens, greedy)
        if "int8_eager" in names:
            engine = GenerationEngine(model, max_slots=b, max_len=max_len, quantize="int8_weight_only")
            runners["int8_eager"] = _engine_runner(engine, prompts, args.new_tokens, greedy)
        warmup = {name: _seconds(run) for name, run in runners.items()}
        best = {name: float("inf") for name in runners}
        # Interleaved repeats, best time per mode: other load on the machine hits all modes alike.
        with torch.no_grad():
            for _ in range(args.repeats):
                for name, run in runners.items():
                    best[name] = min(best[name], _seconds(run))
        for name in runners:  # the second pass's figures replace the first's: all of one batch size from one pass
            modes[name][str(b)] = tokens / best[name]
        if compiled is not None:
            compile_s[str(b)] = warmup["compiled"] - best["compiled"]
            graphs[str(b)] = {"graphs": compiled.compile_stats.graphs, "compile_s": compiled.compile_stats.seconds}
        fused = [modes[m][str(b)] for m in ("eager", "compiled") if str(b) in modes.get(m, {})]
        speedup[str(b)] = max(fused) / modes[baseline][str(b)]
        cells = " ".join(f"{modes[m][str(b)]:>16.1f}" if str(b) in modes[m] else f"{'-':>16}" for m in modes)
        line = f"{b:>5} {cells} {speedup[str(b)]:>17.2f}x"
        if greedy and theirs and ours:
            differing_rows[str(b)] = sum(x != y for x, y in zip(ours["tokens"], theirs["tokens"]))
            line += f"  greedy tokens equal in {b - differing_rows[str(b)]}/{b} rows"
        roof = roofline_tokens_per_s(model, flavor, b, args.prompt_len, args.new_tokens, bandwidth)
        roofline[str(b)] = {m: modes[m][str(b)] / roof for m in modes if str(b) in modes[m]}
        line += "  of roofline: " + " ".join(f"{m} {f:.0%}" for m, f in roofline[str(b)].items())
        print(line, flush=True)
        if args.json:
            print(json.dumps(out | {"partial": True}), flush=True)

    for b in batch_sizes:  # every mode but the compiled one first: their figures come whatever compiling costs
        measure(b, [m for m in modes if m != "compiled"])
    if "compiled" in modes:
        for b in batch_sizes:  # then the compiled engine beside the others again, while the time budget lasts
            if deadline is not None and time.monotonic() > deadline:
                skipped.append(str(b))
                print(f"{b:>5} compiled: not run, --time-budget-s {args.time_budget_s:g} spent", flush=True)
                if args.json:
                    print(json.dumps(out | {"partial": True}), flush=True)
                continue
            measure(b, [m for m in modes if m != "int8_eager"])
    if compile_s:
        print("compile warm-up overhead (s): " + ", ".join(f"batch {b}: {s:.1f}" for b, s in compile_s.items()))
        print(
            "compiled graphs (calls that compiled them, s): "
            + ", ".join(f"batch {b}: {g['graphs']} ({g['compile_s']:.1f})" for b, g in graphs.items())
        )
    sharing = {}
    if args.prefill_groups:
        groups = [int(n) for n in args.prefill_groups.split(",")]
        sharing = prefill_sharing(model, 16, args.prompt_len, groups, max(args.repeats, 3), args.device)
        for n, t in sharing.items():
            print(
                f"prefill of 16 x {args.prompt_len}-token prompts + 1 token, {n} samples per prompt: 16 distinct prompts "
                f"{t['distinct_s'] * 1e3:.0f} ms, {-(-16 // int(n))} prompts shared {t['shared_s'] * 1e3:.0f} ms "
                f"({t['distinct_s'] / t['shared_s']:.1f}x)"
            )
    bucketed = {}
    if not args.no_compile and args.graphs_slots:
        bucketed = bucketed_compile(model, args.graphs_slots, args.graphs_max_len, args.compile_scope)
        print(
            f"bucketed engine ({args.graphs_slots} slots, max_len {args.graphs_max_len}: {bucketed['batch_buckets']} batch x "
            f"{bucketed['len_buckets']} length buckets), {3 * args.graphs_slots} mixed-length requests: "
            f"{bucketed['graphs']} graphs, {bucketed['compile_s']:.1f} s in the calls that compiled them "
            f"({bucketed['wall_s']:.1f} s wall)"
        )
    out |= {"bucketed_compile": bucketed, "prefill_sharing": sharing}
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
