"""The wire protocol (JSON over HTTP/1.1 keep-alive; version `PROTOCOL`).

    GET    /v1/health                         liveness (no auth)
    GET    /v1/info                           target signature, servable drafters, limits
    POST   /v1/sessions                       OpenRequest   -> OpenResponse   (prefill the prompt)
    POST   /v1/sessions/{id}/verify           VerifyRequest -> VerifyResponse (one draft tree)
    DELETE /v1/sessions/{id}                  close
    POST   /v1/generate                       GenerateRequest -> GenerateResponse, or NDJSON lines
                                              (stream=true; a failure mid-stream ends it with an
                                              {"error": ...} line): the plain "API call" baseline

A session is one sequence on the server: the target's KV cache of the tokens it has run
(`length` of them: the prompt, then verified tokens) and its `pending` token (its own latest
choice, not yet run). A verify request names the position of its draft's root, `seq`: the client's
count of tokens the target has run. The server answers deterministically from (seq, tree):

* seq == the server's length: the root must be the pending token; verify, extend.
* seq <  the server's length (a response was lost, the client drafted on alone and now resyncs an
  earlier point): the root must be the token the server has at seq; the cache is cut back to seq
  and the tree verified there. Greedy: the same verified tokens as before, nothing duplicated.
* the same request as the last one: the stored response is replayed (exact idempotency, also
  for sampling).
* seq > the server's length, or a root that contradicts the server's tokens: 409; the client
  reopens the session with its verified prefix (OpenRequest.pending, .sync_from).
* a pipelined round (`after`: sent before the verdict of the client's round `after`): it waits for
  that round (serving/round_order.py), then runs only at exactly the length that round left, from
  the token the target chose next; otherwise 409 with nothing run (the client discards it).

Every request model is strict (no type coercion, no unknown keys) and bounded; the server's
configured limits (`ServerLimits`) are checked on top, each refusal a 4xx with a message: 413 for
a request larger than a limit (prompt, draft, max_tokens, a sequence longer than
`InfoResponse.context_window`), 429 when a client is at its own limit (sessions, generations in
flight), 503 with Retry-After when the server as a whole is (sessions, generations in flight,
the token budget `max_total_tokens`: K/V held at once over all sessions and generations).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from vllm_moa import registry as kinds
from vllm_moa.decoding.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE
from vllm_moa.decoding.tree import depths_from_parents

PROTOCOL = "moa-serve/1"

# Schema ceilings: generous bounds that keep validation itself cheap. The server's configured
# limits (ServerLimits) are smaller and give clearer messages.
HARD_MAX_TOKENS = 1 << 16
HARD_MAX_NODES = 4096
INT32 = 2**31

TokenId = Annotated[int, Field(ge=0, lt=INT32)]
Encoding = Literal["fp16", "int8"]


def _client_kind(name: str) -> str:
    """A drafter kind that drafts on a client (vllm_moa/kinds: those with a client session)."""
    drafting = kinds.names(lambda kind: kind.client_session is not None)
    if name not in drafting:
        raise ValueError(f"drafter kind must be one of {', '.join(drafting)}")
    return name


DrafterKind = Annotated[str, Field(max_length=64), AfterValidator(_client_kind)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ServerLimits(BaseModel):
    """What the server accepts; also reported by /v1/info so a client can size its drafts. The one
    declaration of the server's limits: `vllm-moa serve` derives its flags from it (cli_flags.py)."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(1 << 20, ge=256, description="Largest request body accepted.")
    max_prompt_tokens: int = Field(4096, ge=1, le=HARD_MAX_TOKENS, description="Longest prompt accepted.")
    max_draft_nodes: int = Field(64, ge=1, le=HARD_MAX_NODES - 1, description="Most drafted nodes verified per request.")
    max_new_tokens: int = Field(1024, ge=1, le=HARD_MAX_TOKENS,
                                description="Most tokens one /v1/generate call produces.")
    max_sessions: int = Field(256, ge=1, description="Open sessions in all.")
    max_sessions_per_client: int = Field(64, ge=1, description="Open sessions per client (its token, or its address "
                                                               "without tokens).")
    max_generations: int = Field(16, ge=1, description="/v1/generate calls in flight in all (each holds a worker "
                                                       "thread: keep it below the 40 worker threads).")
    max_generations_per_client: int = Field(4, ge=1, description="/v1/generate calls in flight per client.")
    max_session_tokens: int = Field(8192, ge=2, description="Longest sequence (prompt + generated/verified tokens) "
                                                            "of a session or generation; the target's context "
                                                            "window caps it too.")
    max_total_tokens: int = Field(1 << 16, ge=2, description="Tokens whose K/V the server holds at once, over all "
                                                             "sessions and generations (size it to memory: per "
                                                             "token, 2 x layers x kv_heads x head_dim x bytes per "
                                                             "value).")
    session_idle_ttl_s: float = Field(300.0, gt=0, description="Seconds a session may stay idle.",
                                      json_schema_extra={"cli_flag": "session_ttl"})
    session_max_age_s: float = Field(3600.0, gt=0, description="Seconds a session may live.",
                                     json_schema_extra={"cli_flag": "session_max_age"})
    max_rounds_in_flight: int = Field(4, ge=1, le=64, description="Pipelined verify requests a session may have "
                                                                  "waiting for their earlier round.")
    round_wait_s: float = Field(10.0, gt=0, description="Seconds a pipelined verify request waits for its "
                                                        "earlier round before it is refused (409).",
                                json_schema_extra={"cli_flag": "round_wait"})


class SamplingOptions(_Request):
    """temperature 0 = greedy (the default), as is any temperature below MIN_TEMPERATURE (1e-5);
    at most MAX_TEMPERATURE (100), finite (decoding/sampling.py defines the range). Otherwise the
    server samples losslessly (decoding/verify.sampled_accept) with its own per-session generator,
    seeded by `seed`."""

    temperature: float = Field(0.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False,
                               description=f"0 = greedy (so is anything below {MIN_TEMPERATURE:g}); at most "
                                           f"{MAX_TEMPERATURE:g}")
    top_k: int = Field(0, ge=0, lt=INT32)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)


class SignatureIn(_Request):
    """vllm_moa.config.TargetSignature: the target a drafter was trained for."""

    architecture: str = Field(max_length=128)
    num_layers: int = Field(ge=1, lt=INT32)
    hidden_size: int = Field(ge=1, lt=INT32)
    num_attention_heads: int = Field(ge=1, lt=INT32)
    num_kv_heads: int = Field(ge=1, lt=INT32)
    head_dim: int = Field(ge=1, lt=INT32)
    vocab_size: int = Field(ge=1, lt=INT32)
    name: str = Field("", max_length=256)
    fingerprint: str = Field("", max_length=64)


class DrafterDecl(_Request):
    """The client's drafter. The server refuses one trained for another target (signature), and
    for MoA serves only LSA weights it holds itself (`lsa_fingerprint`, `tli`)."""

    kind: DrafterKind
    target: SignatureIn | None = None
    lsa_fingerprint: str | None = Field(None, max_length=64)
    tli: int = Field(0, ge=0, le=4096)

    @model_validator(mode="after")
    def _complete(self) -> DrafterDecl:
        kind = kinds.get(self.kind)
        if kind.declares_target and self.target is None:
            raise ValueError(f"a {self.kind} drafter must declare the target signature it was trained for")
        if kind.declares_lsa and not self.lsa_fingerprint:
            raise ValueError(f"a {self.kind} drafter must declare lsa_fingerprint (its LSA/Ekv2E weights)")
        return self


class OpenRequest(_Request):
    prompt: list[TokenId] = Field(min_length=1, max_length=HARD_MAX_TOKENS)
    drafter: DrafterDecl
    pending: TokenId | None = None  # reopening: the target's token after `prompt`, already known
    sync_from: int = Field(0, ge=0, lt=INT32)  # send sync rows from this position (what the client lacks)
    encoding: Encoding = "fp16"
    sampling: SamplingOptions = SamplingOptions()


class DraftTreeIn(_Request):
    """Node 0 is the root (the pending token); parents[0] = -1 and 0 <= parents[i] < i."""

    tokens: list[TokenId] = Field(min_length=1, max_length=HARD_MAX_NODES)
    parents: list[int] = Field(min_length=1, max_length=HARD_MAX_NODES)

    @model_validator(mode="after")
    def _shape(self) -> DraftTreeIn:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        if self.parents[0] != -1:
            raise ValueError("tree node 0 (the root) must have parent -1")
        for i, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < i:
                raise ValueError(f"tree node {i} has parent {parent}: parents must come before children")
        return self

    def depths(self) -> list[int]:
        """Each node's depth below the root."""
        return depths_from_parents(self.parents)


class VerifyRequest(_Request):
    """A draft tree at position `seq`. A pipelined round (`after` set) was sent before the verdict
    of the client's round `after`: the server verifies it right after that round, and only if that
    round left the session exactly at `seq` with `tree`'s root as its next token; otherwise
    (the earlier round rejected a draft, or the target chose another next token) it answers 409
    and runs nothing. The client numbers its rounds (`round`, increasing within a session)."""

    seq: int = Field(ge=1, lt=INT32)  # position of the tree's root = tokens the target has run
    tree: DraftTreeIn
    round: int | None = Field(None, ge=0, lt=2**62)  # the client's number for this round
    after: int | None = Field(None, ge=0, lt=2**62)  # pipelined: the round this one follows

    @model_validator(mode="after")
    def _order(self) -> VerifyRequest:
        if self.after is not None and (self.round is None or self.after >= self.round):
            raise ValueError("a pipelined round (after) needs its own, later round number (round > after)")
        return self


class GenerateRequest(_Request):
    prompt: list[TokenId] = Field(min_length=1, max_length=HARD_MAX_TOKENS)
    max_tokens: int = Field(ge=1, le=HARD_MAX_TOKENS)
    sampling: SamplingOptions = SamplingOptions()
    eos_token_id: TokenId | None = None
    stream: bool = False


# -- responses --------------------------------------------------------------------------------
class EncodedTensor(BaseModel):
    """A float tensor on the wire (serving/payload.py)."""

    encoding: Encoding
    shape: list[Annotated[int, Field(ge=0)]]
    data: str
    scale: str | None = None  # int8: fp16 per-row scales


class SyncPayload(BaseModel):
    """What the client's drafter needs from the target for tokens start .. start+count-1.

    MoA:   rows [count, E] (Ekv2E output of LSA over the tokens' per-layer K/V);
           TLI > 0 also tli_keys / tli_values [tli, H_kv, count, d] (the target's last layers)
    EAGLE: hidden [count, E] (the target's final post-norm hidden states)
    independent, n-gram: nothing
    """

    start: int
    count: int
    rows: EncodedTensor | None = None
    tli_keys: EncodedTensor | None = None
    tli_values: EncodedTensor | None = None
    hidden: EncodedTensor | None = None


class OpenResponse(BaseModel):
    session_id: str
    length: int  # tokens the target has run (the prompt): the next verify's seq
    first_token: int  # the target's token after the prompt (the given `pending` when reopening)
    sync: SyncPayload
    idle_ttl_s: float
    server_ms: float


class VerifyResponse(BaseModel):
    seq: int  # the new length: the next verify's seq
    path: list[int]  # accepted node ids, root first
    accepted: list[int]  # tokens of path[1:]
    next_token: int  # the target's token after the path: the next root
    sync: SyncPayload  # for the path's tokens (root included)
    replayed: bool = False
    server_ms: float


class GenerateResponse(BaseModel):
    tokens: list[int]
    finish_reason: Literal["length", "eos"]
    server_ms: float


class DrafterInfo(BaseModel):
    name: str
    kind: DrafterKind
    tli: int = 0
    lsa_fingerprint: str | None = None


class InfoResponse(BaseModel):
    protocol: str
    backend: str
    target: dict
    context_window: int | None  # the longest sequence served: the target's window capped by max_session_tokens
    drafters: list[DrafterInfo]
    limits: ServerLimits
    # a session's first round (after an open or reopen) verifies only the drafted nodes whose
    # positions end in the KV block of its root, blocks of this many tokens; the client drafts no
    # further there. None: no bound (the transformers backend)
    kv_block_size: int | None = None


class ErrorResponse(BaseModel):
    error: str
