"""Where the models shipped inside the package live, and how a drafter named on the command line
or in the API is found among them."""

from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).parent / "assets" / "demo"
SHIPPED_SMOLLM2 = Path(__file__).parent / "assets" / "smollm2"


MOA_DRAFTERS = ("moa-tli0", "moa-tli1")
SHIPPED_DRAFTERS = (*MOA_DRAFTERS, "eagle", "independent")


def drafter_directory(spec: str | Path) -> Path:
    """A drafter directory given as a path or as the name of a shipped demo drafter."""
    if Path(spec).is_dir():
        return Path(spec)
    if str(spec) in SHIPPED_DRAFTERS:
        return SHIPPED / str(spec)
    raise FileNotFoundError(f"drafter {str(spec)!r} is neither a directory nor a shipped demo drafter "
                            f"({', '.join(SHIPPED_DRAFTERS)})")
