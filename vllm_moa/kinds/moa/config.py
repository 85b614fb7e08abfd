"""The MoA drafter's configuration (config.json, model_type "moa_drafter")."""

from __future__ import annotations

from typing import ClassVar

from vllm_moa.config import DrafterConfigBase, DrafterConfigError, Option, check_divisible, check_positive

# a window narrower than a draft is deep would leave a drafted position no verified row to read
MIN_ATTENTION_WINDOW = 32


class MoAConfig(DrafterConfigBase):
    """The MoA drafter: LSA over the target's layer axis -> Ekv2E rows -> SA -> CA -> TLI.

    LSA runs at width `2 * Ekv` (the per-token concatenation of one layer's K and V);
    `lsa_num_heads` must divide it. SA and CA run at the target's hidden size `E`.
    """

    model_type = "moa_drafter"
    SPECULATORS_ALGORITHM = "moa"  # `vllm serve <drafter dir>` (speculators_format.py)
    OPTIONS: ClassVar[dict[str, Option]] = {
        "tli": Option(int, 0, "target layer inference: the target's last N layers run on the drafter's output"),
        "lsa_num_heads": Option(int, 4, "LSA heads (divide the LSA width 2*Ekv into even-sized heads)"),
        "lsa_intermediate_size": Option(int, 256, "LSA SwiGLU hidden size"),
        "lsa_rope_theta": Option(float, 10000.0, "rotary base of LSA (positions: index among the layers it reads)"),
        "lsa_layer_stride": Option(int, 1, "LSA reads every n-th target layer counted back from the last, which "
                                           "is always read (1: all; 3 on 30 layers: 10 of them)", required=False),
        "final_hidden_rows": Option(bool, False, "each CA row also carries its token's final post-norm target hidden "
                                                 "state (EAGLE's input), through a zero-initialised E->E projection "
                                                 "added to Ekv2E's output", required=False),
        "sa_num_heads": Option(int, 4, "self-attention heads"),
        "sa_num_kv_heads": Option(int, 2, "self-attention key/value heads (divides sa_num_heads)"),
        "sa_head_dim": Option(int, 16, "self-attention head size (even)"),
        "sa_intermediate_size": Option(int, 256, "self-attention block's SwiGLU hidden size"),
        "ca_num_heads": Option(int, 4, "cross-attention heads"),
        "ca_num_kv_heads": Option(int, 2, "cross-attention key/value heads (divides ca_num_heads)"),
        "ca_head_dim": Option(int, 16, "cross-attention head size (even)"),
        "ca_intermediate_size": Option(int, 256, "cross-attention block's SwiGLU hidden size"),
        "rope_theta": Option(float, 10000.0, "rotary base of SA and CA (token positions)"),
        "attention_window": Option(int, 0, "SA and CA read only the last W token positions, the query's own "
                                           "included (0: all of them); the TLI layers read all",
                                   required=False),
        "rms_norm_eps": Option(float, 1e-6, "RMSNorm epsilon"),
    }

    @property
    def lsa_layers(self) -> tuple[int, ...]:
        """The target layers LSA reads, in order (the last layer always among them)."""
        num_layers = self.target_signature.num_layers
        return tuple(range(num_layers - 1, -1, -self.lsa_layer_stride))[::-1]

    def check_values(self, source: str = "config") -> None:
        sig = self.target_signature
        if not 1 <= self.lsa_layer_stride <= sig.num_layers:
            raise DrafterConfigError(f"{source}: key 'lsa_layer_stride' must be in 1..{sig.num_layers} (target "
                                     f"layers), got {self.lsa_layer_stride}")
        check_positive(self, source, "lsa_num_heads", "lsa_intermediate_size", "sa_num_heads",
                  "sa_num_kv_heads", "sa_head_dim", "sa_intermediate_size", "ca_num_heads",
                  "ca_num_kv_heads", "ca_head_dim", "ca_intermediate_size")
        if self.attention_window and self.attention_window < MIN_ATTENTION_WINDOW:
            raise DrafterConfigError(f"{source}: key 'attention_window' must be 0 (no window) or at least "
                                     f"{MIN_ATTENTION_WINDOW} (a draft must reach its verified rows), got "
                                     f"{self.attention_window}")
        if not 0 <= self.tli <= sig.num_layers:
            raise DrafterConfigError(
                f"{source}: key 'tli' must be in 0..{sig.num_layers} (target layers), got {self.tli}"
            )
        lsa_width = 2 * sig.kv_width
        if lsa_width % self.lsa_num_heads or (lsa_width // self.lsa_num_heads) % 2:
            raise DrafterConfigError(
                f"{source}: key 'lsa_num_heads'={self.lsa_num_heads} must divide the LSA width "
                f"2*Ekv={lsa_width} into heads of even size"
            )
        check_divisible(self, source, "sa_num_heads", "sa_num_kv_heads")
        check_divisible(self, source, "ca_num_heads", "ca_num_kv_heads")
        for key in ("sa_head_dim", "ca_head_dim"):
            if getattr(self, key) % 2:
                raise DrafterConfigError(f"{source}: key {key!r} must be even (rotary embedding)")
