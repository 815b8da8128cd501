"""The test suite's own scheduling (tests/conftest.py): the Ray modules, which take one shared lock, are
spread through the collection so two xdist workers rarely hold one each at the same time."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from conftest import SLOW_MODULES, spread_ray_modules


def test_ray_modules_are_spread_and_every_item_kept_in_its_module_order():
    names = [f"test_{c}.py" for c in "abcdef"] + sorted(SLOW_MODULES)
    items = [SimpleNamespace(path=Path("tests") / name, n=i) for name in names for i in range(2)]
    spread = spread_ray_modules(items)
    assert sorted(map(id, spread)) == sorted(map(id, items))
    files = list(dict.fromkeys(item.path.name for item in spread))
    assert files == ["test_ray_cluster.py", "test_a.py", "test_b.py", "test_ray_serve.py", "test_c.py",
                     "test_d.py", "test_ray_sweep.py", "test_e.py", "test_f.py"]
    assert all([i.n for i in spread if i.path.name == name] == [0, 1] for name in names)
