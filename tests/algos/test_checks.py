"""The shared helpers of proxima.algos and the import rules between its modules."""

import ast
from pathlib import Path

import pytest
import torch

import proxima.algos
from proxima.algos._checks import check_same_shape, check_temperature, map_row_chunks, select

ALGOS_DIR = Path(proxima.algos.__file__).parent
ALGOS_FILES = sorted(ALGOS_DIR.glob("*.py"))


def _imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


@pytest.mark.parametrize("path", ALGOS_FILES, ids=lambda p: p.name)
def test_no_algos_file_imports_another_files_private_names(path):
    # Shared helpers live in _checks.py under public names; nobody reaches into a sibling's
    # underscore names (importing from the private module _checks itself is the rule).
    for node in _imports(path):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            private = [alias.name for alias in node.names if alias.name.startswith("_")]
            assert not private, f"{path.name} imports {private} from .{node.module}"


@pytest.mark.parametrize("path", ALGOS_FILES, ids=lambda p: p.name)
def test_algos_imports_nothing_else_from_proxima(path):
    for node in _imports(path):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                continue  # relative: inside proxima.algos
            assert not name.startswith("proxima"), f"{path.name} imports {name}"


def test_select_hides_nan_and_inf_and_has_zero_gradient_there():
    # [nan, 2, inf] with mask [0, 1, 0] -> [0, 2, 0]; d sum / dx = [0, 1, 0].
    x = torch.tensor([float("nan"), 2.0, float("inf")], requires_grad=True)
    out = select(x, torch.tensor([0, 1, 0]))
    assert out.tolist() == [0.0, 2.0, 0.0]
    out.sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 0.0]


def test_check_same_shape_names_the_tensors():
    check_same_shape("f", a=torch.zeros(2, 3), b=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"f: shape mismatch: a \[2, 3\] vs c \[3\]"):
        check_same_shape("f", a=torch.zeros(2, 3), b=torch.zeros(2, 3), c=torch.zeros(3))


def test_check_temperature():
    check_temperature("f", 0.5)
    with pytest.raises(ValueError, match="f: temperature must be > 0, got 0"):
        check_temperature("f", 0)


def test_map_row_chunks_any_chunk_size_and_empty():
    # Row sums of a [2, 3, 2] tensor: rows (0, 1), (2, 3), ... -> 1, 5, 9, 13, 17, 21.
    x = torch.arange(12.0).reshape(2, 3, 2)
    for chunk_size in (None, 1, 4, 100):
        out = map_row_chunks(lambda c: c.sum(-1), x, chunk_size=chunk_size)
        assert out.tolist() == [[1.0, 5.0, 9.0], [13.0, 17.0, 21.0]]
    empty = map_row_chunks(lambda c: c.sum(-1), torch.zeros(0, 3, 2))
    assert empty.shape == (0, 3) and empty.dtype == torch.float32
