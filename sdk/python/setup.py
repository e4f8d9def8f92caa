"""Compiles proto/dtx/v1 into dtx/v1 before setuptools collects the
packages, so a wheel carries the generated modules (see dtx/_gen.py)."""

import importlib.util
from pathlib import Path

from setuptools import setup

_spec = importlib.util.spec_from_file_location("_dtx_gen", Path(__file__).parent / "dtx" / "_gen.py")
assert _spec is not None and _spec.loader is not None
_gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gen)
_gen.generate()

setup()
