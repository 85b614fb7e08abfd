"""server_load.py's clients, one function per kind (see server_load.py's docstring), and the health
prober; each records every answer in the shared Context."""

from __future__ import annotations

import json
import random
import threading
import time

from benchmarks.load_recorder import KINDS, REFUSALS, TIMEOUT_S, response_json


# -- clients ------------------------------------------------------------------------------------------
class Context:
    """What every client thread shares."""

    def __init__(self, args, url, target, drafters, prompts, reference, recorder, deadline) -> None:
        self.args, self.url, self.target, self.drafters = args, url, target, drafters
        self.prompts, self.reference, self.rec, self.deadline = prompts, reference, recorder, deadline
        from vllm_moa.serving.local import open_local

        self.decls = {name: open_local(d, target).declaration().model_dump(mode="json")
                      for name, d in drafters.items()}
        self.decls["ngram"] = {"kind": "ngram"}
        self.stop = threading.Event()  # set on a hard stop (grace period over)

    def http(self, token: str, timeout=TIMEOUT_S):
        import httpx

        return self.rec.wrap(httpx.Client(base_url=self.url, timeout=timeout,
                                          headers={"authorization": f"Bearer {token}"}))

    def work(self, rng: random.Random) -> tuple[int, list[int], int]:
        """A prompt index, its ids, and a number of new tokens."""
        p = rng.randrange(len(self.prompts))
        return p, self.prompts[p], rng.randint(self.args.min_new_tokens, self.args.max_new_tokens)

    def expected(self, p: int, n: int) -> list[int]:
        return self.reference[p][:n]

    def running(self) -> bool:
        return time.monotonic() < self.deadline and not self.stop.is_set()

    def check(self, kind: str, what: str, got: list[int], want: list[int], seconds: float | None = None) -> bool:
        if got == want:
            self.rec.outcome(kind, "exact", seconds)
            return True
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        self.rec.outcome(kind, "mismatch")
        self.rec.fail(f"{kind}: {what} differs from greedy decoding at token {first} "
                      f"({len(got)} tokens, expected {len(want)}; got {got[first:first + 4]}, "
                      f"want {want[first:first + 4]})")
        return False

    def refused(self, kind: str, status: int, rng: random.Random) -> None:
        self.rec.outcome(kind, f"refused-{status}")
        time.sleep(rng.uniform(0.1, 0.6))


def _drafting_client(ctx: Context, kind: str, index: int, token: str, rng: random.Random) -> None:
    from vllm_moa.serving.client import RemoteDraftingClient, RequestRefused, ServerUnavailable

    while ctx.running():
        p, prompt, n = ctx.work(rng)
        if kind == "draft-chain":
            name, width = "moa-tli0", None
        else:
            names = [n for n in ("moa-tli0", "moa-tli1") if n in ctx.drafters]
            name, width = names[(index // len(KINDS)) % len(names)], 4
        num_draft = rng.choice([None, 2, 4, 6])
        encoding = rng.choice(["fp16", "fp16", "int8"])
        # a new client (and connection) now and then: /v1/info and connection churn
        client = RemoteDraftingClient(ctx.url, ctx.drafters[name], ctx.target, token=token, encoding=encoding,
                                      num_draft=num_draft, tree_top_k=width, timeout=TIMEOUT_S, backoff_s=0.05,
                                      backoff_max_s=1.0, give_up_after_s=ctx.args.give_up_after, seed=rng.randrange(2**31))
        ctx.rec.wrap(client.transport.http)
        t0 = time.perf_counter()
        try:
            with client:
                result = client.generate(prompt, n)
        except RequestRefused as err:
            if err.status in REFUSALS:
                ctx.refused(kind, err.status, rng)
                continue
            ctx.rec.fail(f"{kind}: refused {err.status}: {err.message}")
            continue
        except ServerUnavailable as err:
            ctx.rec.outcome(kind, "gave-up")
            ctx.rec.fail(f"{kind}: gave up: {err}")
            continue
        if result.num_verified != len(result.token_ids):
            ctx.rec.fail(f"{kind}: only {result.num_verified} of {len(result.token_ids)} tokens verified "
                         f"({result.finish_reason})")
        ctx.check(kind, f"{name} {'tree' if width else 'chain'} output", result.token_ids, ctx.expected(p, n),
                  time.perf_counter() - t0)


def _tree(rng: random.Random, root: int, right: list[int], vocab: int, max_nodes: int) -> tuple[dict, int]:
    """A draft tree rooted at `root`: a few wrong first tokens as siblings, then a chain whose first
    `j` tokens are `right` (the greedy continuation) and whose next ones are wrong. Returns the tree
    and j: greedy verification must accept exactly right[:j]."""
    def wrong(than: int) -> int:
        token = rng.randrange(vocab)
        return token if token != than else (token + 1) % vocab

    tokens, parents = [root], [-1]
    for _ in range(rng.choice([0, 0, 1, 2])):  # wrong branches (a wrong token, maybe a child under it)
        tokens.append(wrong(right[0]))
        parents.append(0)
        if rng.random() < 0.5:
            tokens.append(right[1])  # right token under a wrong parent: must not be accepted
            parents.append(len(tokens) - 2)
    depth = rng.randint(1, min(8, max_nodes - len(tokens)))
    j = rng.randint(0, depth)
    parent = 0
    for d in range(depth):
        tokens.append(right[d] if d < j else wrong(right[d]))
        parents.append(parent)
        parent = len(tokens) - 1
    return {"tokens": tokens, "parents": parents}, j


def _session_rounds(ctx: Context, kind: str, http, rng: random.Random, p: int, prompt: list[int], n: int,
                    rounds: int | None) -> tuple[str | None, list[int]] | None:
    """Open a session and verify rounds of drafts made from the greedy continuation (checking every
    verdict) until `n` tokens (rounds None) or `rounds` rounds. Returns (session id, verified
    tokens), or None if refused / failed."""
    ref = ctx.reference[p]
    decl = rng.choice(sorted(ctx.decls))
    r = http.post("/v1/sessions", json={"prompt": prompt, "drafter": ctx.decls[decl],
                                        "encoding": rng.choice(["fp16", "int8"])})
    if r.status_code in REFUSALS:
        ctx.refused(kind, r.status_code, rng)
        return None
    if r.status_code != 200:
        return None  # recorded by the recorder
    opened = r.json()
    sid, seq = opened["session_id"], opened["length"]
    if seq != len(prompt) or opened["first_token"] != ref[0]:
        ctx.check(kind, "first token", [opened["first_token"]], ref[:1])
        return sid, []
    out = [opened["first_token"]]  # out[-1]: the pending token; prompt + out[:-1] have been run
    done = 0
    while (len(out) < n) if rounds is None else (done < rounds):
        m = len(out) - 1  # index in `out` of the draft's root
        if m > 0 and rng.random() < 0.1:  # rewind: verify again from an earlier position
            m = rng.randrange(0, m)
        root_seq = len(prompt) + m
        tree, j = _tree(rng, out[m], ref[m + 1:], ctx.target.vocab_size, 16)
        body = {"seq": root_seq, "tree": tree}
        deliberate = kind == "abandon" and rng.random() < 0.3
        if deliberate:  # the client hangs up before the answer comes; the session is abandoned
            import httpx

            ctx.rec.local.deliberate = True
            try:
                http.post(f"/v1/sessions/{sid}/verify", json=body, timeout=httpx.Timeout(5.0, read=0.002))
            except httpx.TimeoutException:
                ctx.rec.outcome(kind, "aborted-verify")
                return sid, out
            finally:
                ctx.rec.local.deliberate = False
        for attempt in range(2 if rng.random() < 0.1 else 1):  # now and then the same request twice
            while True:
                r = http.post(f"/v1/sessions/{sid}/verify", json=body)
                if r.status_code != 503 or ctx.stop.is_set():
                    break
                ctx.refused(kind, r.status_code, rng)  # over the token budget: retry (idempotent)
            if r.status_code != 200:
                return sid, out  # a refusal, or recorded as a failure by the recorder
            verdict = r.json()
            if attempt == 1 and not verdict.get("replayed"):
                ctx.rec.fail(f"{kind}: the same verify request twice was not replayed")
        got = verdict["accepted"] + [verdict["next_token"]]
        # greedy: the accepted drafts and the next token are the target's own tokens; a server may
        # verify fewer of the correct drafts than were sent (the vLLM backend cuts a new-request
        # round at its root's KV block), never more
        want = ref[m + 1 : m + 1 + min(j, len(got) - 1)] + [ref[m + min(j, len(got) - 1) + 1]]
        if got != want or verdict["seq"] != root_seq + len(got):
            ctx.check(kind, f"verdict (seq {root_seq}, {len(tree['tokens'])} nodes)", got, want)
            return sid, []
        out = out[: m + 1] + got
        done += 1
    return sid, out


def _raw_session_client(ctx: Context, kind: str, index: int, token: str, rng: random.Random) -> None:
    http = ctx.http(token)
    with http:
        while ctx.running():
            p, prompt, n = ctx.work(rng)
            t0 = time.perf_counter()
            rounds = None if kind == "verify-raw" else rng.randint(0, 3)
            got = _session_rounds(ctx, kind, http, rng, p, prompt, n, rounds)
            if got is None:
                continue
            sid, out = got
            if not out:
                continue  # a mismatch, recorded
            if kind == "verify-raw":
                ctx.check(kind, "session output", out[:n], ctx.expected(p, n), time.perf_counter() - t0)
                r = http.delete(f"/v1/sessions/{sid}")
                if r.status_code != 200:
                    ctx.rec.fail(f"{kind}: close answered {r.status_code}")
            else:  # abandon: leave it open; what was verified must still be greedy
                ctx.check(kind, "abandoned session's prefix", out, ctx.reference[p][: len(out)],
                          time.perf_counter() - t0)
                time.sleep(rng.uniform(0.0, 0.5))


def _generate_client(ctx: Context, kind: str, index: int, token: str, rng: random.Random) -> None:
    import httpx

    from vllm_moa.serving.client import RemoteDraftingClient, RequestRefused, ServerUnavailable

    http = ctx.http(token)
    with http:
        while ctx.running():
            p, prompt, n = ctx.work(rng)
            want = ctx.expected(p, n)
            body = {"prompt": prompt, "max_tokens": n}
            t0 = time.perf_counter()
            if kind == "generate":
                r = http.post("/v1/generate", json=body)
                if r.status_code in REFUSALS:
                    ctx.refused(kind, r.status_code, rng)
                elif r.status_code == 200:
                    ctx.check(kind, "generate output", r.json()["tokens"], want, time.perf_counter() - t0)
                continue
            if kind == "generate-stream" and rng.random() < 0.3:  # the API-baseline client
                client = RemoteDraftingClient(ctx.url, None, token=token, timeout=TIMEOUT_S,
                                              give_up_after_s=ctx.args.give_up_after)
                ctx.rec.wrap(client.transport.http)
                try:
                    with client:
                        result = client.generate(prompt, n)
                except RequestRefused as err:
                    if err.status in REFUSALS:
                        ctx.refused(kind, err.status, rng)
                    else:
                        ctx.rec.fail(f"{kind}: refused {err.status}: {err.message}")
                    continue
                except ServerUnavailable as err:
                    ctx.rec.fail(f"{kind}: gave up: {err}")
                    continue
                ctx.check(kind, "API client output", result.token_ids, want, time.perf_counter() - t0)
                continue
            if kind == "stream-disconnect" and rng.random() < 0.3:  # give up before the answer
                ctx.rec.local.deliberate = True
                try:
                    r = http.post("/v1/generate", json=body, timeout=httpx.Timeout(5.0, read=0.002))
                    if r.status_code in REFUSALS:
                        ctx.refused(kind, r.status_code, rng)
                    elif r.status_code == 200:  # it was faster than the timeout
                        ctx.check(kind, "generate output", r.json()["tokens"], want, time.perf_counter() - t0)
                except httpx.TimeoutException:
                    ctx.rec.outcome(kind, "aborted-generate")
                finally:
                    ctx.rec.local.deliberate = False
                continue
            hang_up = rng.randint(1, max(1, n - 1)) if kind == "stream-disconnect" else None
            tokens, lines = [], []
            with http.stream("POST", "/v1/generate", json={**body, "stream": True}) as r:
                if r.status_code in REFUSALS:
                    r.read()
                    if r.status_code == 503 and ("retry-after" not in r.headers or "error" not in response_json(r)):
                        ctx.rec.fail(f"{kind}: 503 without Retry-After or error message")
                    ctx.refused(kind, r.status_code, rng)
                    continue
                if r.status_code != 200:
                    continue  # recorded
                try:
                    for line in r.iter_lines():
                        if not line.strip():
                            continue
                        data = json.loads(line)
                        lines.append(data)
                        if "error" in data:
                            ctx.rec.fail(f"{kind}: error line in the stream: {data}")
                            break
                        tokens += data.get("tokens", [])
                        if hang_up is not None and len(tokens) >= hang_up:
                            break  # hang up mid-stream (closing the response closes the connection)
                except httpx.HTTPError as err:
                    ctx.rec.fail(f"{kind}: stream broke: {type(err).__name__}: {err}")
                    continue
            if hang_up is not None:
                ctx.rec.outcome(kind, "hung-up-mid-stream" if len(tokens) < n else "stream-ended-first")
                ctx.check(kind, "streamed prefix before hanging up", tokens, want[: len(tokens)],
                          time.perf_counter() - t0)
            else:
                if not lines or not lines[-1].get("done") or lines[-1].get("finish_reason") != "length":
                    ctx.rec.fail(f"{kind}: the stream did not end with a done line: {lines[-1:]}")
                ctx.check(kind, "streamed output", tokens, want, time.perf_counter() - t0)


def client_thread(ctx: Context, kind: str, index: int, token: str) -> None:
    rng = random.Random(ctx.args.seed * 1000 + index)
    runner = {"draft-chain": _drafting_client, "draft-tree": _drafting_client, "verify-raw": _raw_session_client,
              "abandon": _raw_session_client, "hostile": _hostile_client}.get(kind, _generate_client)
    try:
        runner(ctx, kind, index, token, rng)
    except Exception as err:  # noqa: BLE001 - a client bug or an unusable answer: a failure
        import traceback

        ctx.rec.fail(f"{kind} client {index} crashed: {type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}")


# -- hostile requests: each must get its 4xx (or, for odd but valid parameters, a correct answer) ------
def _hostile_cases(ctx: Context, rng: random.Random) -> tuple[list[tuple[str, str, str, object, tuple[int, ...]]], int]:
    """([(case, method, path, JSON body or raw bytes, acceptable statuses)], the prompt index used)."""
    p, prompt, _ = ctx.work(rng)
    vocab = ctx.target.vocab_size
    ngram = {"kind": "ngram"}
    limit = ctx.args.limits["max_new_tokens"]
    return [
        ("token-outside-vocab", "POST", "/v1/sessions", {"prompt": [*prompt[:4], vocab + 7], "drafter": ngram}, (400,)),
        ("temperature-nan", "POST", "/v1/generate",
         b'{"prompt": [1, 2], "max_tokens": 4, "sampling": {"temperature": NaN}}', (422,)),
        ("temperature-negative", "POST", "/v1/generate",
         {"prompt": prompt, "max_tokens": 4, "sampling": {"temperature": -0.5}}, (422,)),
        ("temperature-huge", "POST", "/v1/sessions",
         {"prompt": prompt, "drafter": ngram, "sampling": {"temperature": 1e300}}, (422,)),
        ("top-p-zero", "POST", "/v1/generate", {"prompt": prompt, "max_tokens": 4, "sampling": {"top_p": 0}}, (422,)),
        ("max-tokens-huge", "POST", "/v1/generate", {"prompt": prompt, "max_tokens": 10**12}, (422,)),
        ("max-tokens-over-limit", "POST", "/v1/generate", {"prompt": prompt, "max_tokens": limit + 1}, (413,)),
        ("empty-prompt", "POST", "/v1/sessions", {"prompt": [], "drafter": ngram}, (422,)),
        ("unknown-kind", "POST", "/v1/sessions", {"prompt": prompt, "drafter": {"kind": "gpt-17"}}, (422,)),
        ("unknown-field", "POST", "/v1/generate", {"prompt": prompt, "max_tokens": 4, "n": 2}, (422,)),
        ("string-tokens", "POST", "/v1/generate", {"prompt": ["hello"], "max_tokens": 4}, (422,)),
        ("not-json", "POST", "/v1/sessions", b"{prompt: [1, 2", (422,)),
        ("sync-from-past-prompt", "POST", "/v1/sessions",
         {"prompt": prompt, "drafter": ngram, "sync_from": len(prompt) + 5}, (400,)),
        ("unknown-session", "POST", "/v1/sessions/nosuchsession0/verify",
         {"seq": 3, "tree": {"tokens": [1], "parents": [-1]}}, (404,)),
        ("bad-session-id", "DELETE", "/v1/sessions/..%2Fetc", None, (404, 422)),
        ("lsa-not-held", "POST", "/v1/sessions",
         {"prompt": prompt, "drafter": {**ctx.decls.get("moa-tli0", ngram), "lsa_fingerprint": "0" * 16}}
         if "moa-tli0" in ctx.decls else {"prompt": prompt, "drafter": {"kind": "moa"}}, (409, 422)),
        # odd but valid: answered, and greedy where the temperature is below 1e-5
        ("temperature-1e-40", "POST", "/v1/generate",
         {"prompt": prompt, "max_tokens": 6, "sampling": {"temperature": 1e-40}}, (200,)),
        ("seed-and-top-k-at-their-bounds", "POST", "/v1/generate",
         {"prompt": prompt, "max_tokens": 3, "sampling": {"temperature": 0.8, "top_k": 2**31 - 1,
                                                          "seed": 2**63 - 1}}, (200,)),
    ], p


def _hostile_client(ctx: Context, kind: str, index: int, token: str, rng: random.Random) -> None:
    """Hostile and odd requests, one at a time: each answered with the status it deserves (a 4xx
    with an error message, never a 5xx), the valid odd ones with correct output."""
    http = ctx.http(token)
    with http:
        sent, checked = 0, 0
        while ctx.running():
            cases, p = _hostile_cases(ctx, rng)
            # the odd-but-valid greedy case until one is answered (a refusal does not count), then every
            # 12th: checked output each run, even a short one under contention
            by_name = {c[0]: c for c in cases}
            greedy = checked == 0 or sent % 12 == 0
            case, method, path, body, statuses = by_name["temperature-1e-40"] if greedy else rng.choice(cases)
            sent += 1
            ctx.rec.local.hostile = statuses != (200,)
            try:
                kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                    else ({"json": body} if body is not None else {})
                r = http.request(method, path, **kwargs)
            finally:
                ctx.rec.local.hostile = False
            ctx.rec.hostile[case] += statuses != (200,)
            if r.status_code in REFUSALS:
                ctx.refused(kind, r.status_code, rng)
                continue
            if r.status_code not in statuses:
                ctx.rec.fail(f"hostile {case}: answered {r.status_code}, expected {statuses}: {r.text[:200]}")
            elif r.status_code >= 400 and "error" not in response_json(r):
                ctx.rec.fail(f"hostile {case}: {r.status_code} without an error message: {r.text[:200]}")
            elif case == "temperature-1e-40":
                ctx.check(kind, "greedy at temperature 1e-40", r.json()["tokens"], ctx.expected(p, 6))
                checked += 1
                continue
            ctx.rec.outcome(kind, f"answered-{r.status_code}")
            time.sleep(rng.uniform(0.02, 0.1))


def health_prober(ctx: Context, period: float = 0.25) -> None:
    import httpx

    http = ctx.rec.wrap(httpx.Client(base_url=ctx.url, timeout=TIMEOUT_S))
    with http:
        while ctx.running():
            try:
                r = http.get("/v1/health")
                if r.status_code != 200 or r.json().get("status") != "ok":
                    ctx.rec.fail(f"health answered {r.status_code}: {r.text[:200]}")
            except httpx.HTTPError:
                pass  # recorded
            time.sleep(period)


