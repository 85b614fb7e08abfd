"""A MoA drafter shipped for SmolLM2 reads the last 256 positions / rows (recipes/smollm2.py's
SHIPPED_ATTENTION_WINDOWS): every way of shipping goes through write_fp16, which sets it unless the
run chose a window of its own; the committed drafter has it."""

import json

import pytest
from tiny_models import make_target

from vllm_moa.kinds.moa import MoAConfig, MoADrafter
from vllm_moa.recipes.smollm2 import SHIPPED_ATTENTION_WINDOWS, write_fp16
from vllm_moa.shipped import SHIPPED_SMOLLM2


@pytest.mark.parametrize("name,own,shipped", [("moa-tli0", 0, 256), ("moa-tli0", 64, 64), ("moa-other", 0, 0)])
def test_shipping_sets_the_window_unless_the_run_chose_one(tmp_path, name, own, shipped):
    drafter = MoADrafter(MoAConfig(target=make_target("llama").signature, lsa_num_heads=4, attention_window=own))
    drafter.save_pretrained(tmp_path / "run")
    write_fp16(tmp_path / "run", tmp_path / "assets" / name)
    assert json.loads((tmp_path / "assets" / name / "config.json").read_text())["attention_window"] == shipped


def test_the_committed_moa_drafter_ships_with_its_window():
    config = json.loads((SHIPPED_SMOLLM2 / "moa-tli0" / "config.json").read_text())
    assert config["attention_window"] == SHIPPED_ATTENTION_WINDOWS["moa-tli0"] == 256
