"""Rebuild nexttoken/default_model: a shortcut for `python -m nexttoken.training` (see docs/default_model.md)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nexttoken.training.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
