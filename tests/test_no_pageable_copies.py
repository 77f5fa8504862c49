"""No ``torch.tensor(..., device=...)`` in the library outside the places allowed below: on CUDA it builds the
tensor in pageable host memory and copies it with a blocking copy, so the host waits for every kernel queued
before it; nor a host tensor just made and moved with ``.to(device)`` (a copy from pageable memory, which the
driver may start only once the stream has drained, ``non_blocking`` or not). A call's index tensors go through ``distcomm_attention._device`` (``to_device``: pinned and
non-blocking; ``on_device``: once per cached host index) instead. This is how the packed calls' varlen
boundaries made every call with new documents wait for the GPU (tests/test_gpu_host_sync.py found it on 2
GPUs); this test keeps the pattern from coming back where no GPU test runs."""

import ast
from pathlib import Path

import distcomm_attention

PACKAGE = Path(distcomm_attention.__file__).resolve().parent
ALLOWED = {  # (file relative to the package, function): why a blocking copy is acceptable there
    ("integrations/huggingface.py", "_verify_positions"): "check mode only, which gathers across ranks anyway",
    ("planning/visibility.py", "visible_mask"): "the element-wise reference mask the tests compare plans with",
}


def _gives_device(keywords, device_dicts) -> bool:
    """Whether call keywords pass a ``device`` other than "cpu", directly or by ``**name`` of a ``dict(...,
    device=...)`` assigned in the same function."""
    for k in keywords:
        if k.arg == "device" and not (isinstance(k.value, ast.Constant) and k.value.value == "cpu"):
            return True
        if k.arg is None and isinstance(k.value, ast.Name) and k.value.id in device_dicts:
            return True
    return False


_MADE = ("tensor", "as_tensor", "arange", "cat", "stack", "from_numpy")  # torch functions that make a host tensor


def _made_on_host(node) -> bool:
    """Whether ``node`` is a ``torch.<_MADE>(...)`` call given no device (a host tensor)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            and node.func.attr in _MADE and not any(k.arg == "device" for k in node.keywords))


def _moves(call: ast.Call, host_names=frozenset()) -> bool:
    """Whether ``x.to(...)`` / ``x.cuda()`` with ``x`` a tensor made by ``torch.<_MADE>(...)`` on the host (the call
    itself, or a name the function assigned it to), or ``x.pin_memory()`` without ``non_blocking=True``, moves it
    to a device: ``.cuda()``, a ``device=`` keyword, or a
    first argument that is not a dtype (``torch.int32``, ``something.dtype``)."""
    receiver = call.func.value
    made = _made_on_host(receiver) or (isinstance(receiver, ast.Name) and receiver.id in host_names)
    pinned = (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute)
              and receiver.func.attr == "pin_memory")
    if pinned:  # from pinned memory only a non-blocking copy leaves the host free
        made = not any(k.arg == "non_blocking" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in call.keywords)
    if not made:
        return False
    if call.func.attr == "cuda" or any(k.arg == "device" for k in call.keywords):
        return True
    first = call.args[0] if call.args else None
    dtype = isinstance(first, ast.Attribute) and (first.attr == "dtype" or (
        isinstance(first.value, ast.Name) and first.value.id == "torch"))
    return first is not None and not dtype


def _device_tensors(source: str):
    """(line, enclosing function) of every ``torch.tensor`` / ``torch.as_tensor`` call given a ``device`` other
    than the literal "cpu" (as a keyword, or inside a ``dict(...)`` of the same function passed with ``**``), and
    of every host tensor just made and moved to a device with ``.to(...)`` / ``.cuda()`` (not pinned)."""
    found = []

    def visit(node, function, device_dicts, host_names):
        for child in ast.iter_child_nodes(node):
            name, dicts, hosts = function, device_dicts, host_names
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assigned = [(t.id, a.value) for a in ast.walk(child) if isinstance(a, ast.Assign)
                            for t in a.targets if isinstance(t, ast.Name)]
                name = child.name
                dicts = {n for n, v in assigned if isinstance(v, ast.Call) and isinstance(v.func, ast.Name)
                         and v.func.id == "dict" and _gives_device(v.keywords, set())}
                hosts = frozenset(n for n, v in assigned if _made_on_host(v))
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in ("tensor", "as_tensor") and isinstance(child.func.value, ast.Name)
                    and child.func.value.id == "torch" and _gives_device(child.keywords, device_dicts)):
                found.append((child.lineno, function))
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                  and child.func.attr in ("to", "cuda") and _moves(child, host_names)):
                found.append((child.lineno, function))
            visit(child, name, dicts, hosts)

    visit(ast.parse(source), None, set(), frozenset())
    return found


def test_the_finder_sees_the_pattern():
    source = ("import torch\ndef f(x):\n    a = torch.tensor([1], device=x.device)\n"
              "    b = torch.tensor([1], device='cpu')\n    return torch.as_tensor([2], dtype=None, device=x.device)\n"
              "def g(x):\n    i32 = dict(dtype=torch.int32, device=x.device)\n    host = dict(dtype=torch.int32)\n"
              "    return torch.tensor([1], **i32), torch.tensor([2], **host)\n"
              "def h(x):\n    a = torch.tensor([1]).to(x.device, non_blocking=True)\n"
              "    b = torch.arange(3).to(torch.int32)\n    c = torch.cat([x]).to(x.dtype)\n"
              "    return torch.stack([x]).cuda(), torch.tensor([1]).pin_memory().to(x.device, non_blocking=True)\n"
              "def k(x):\n    index = torch.tensor([1, 2])\n    y = index.to(torch.int32)\n    return index.to(x.device)\n"
              "def m(x, i):\n    return i.pin_memory().to(x.device)\n")
    assert _device_tensors(source) == [(3, "f"), (5, "f"), (9, "g"), (11, "h"), (14, "h"), (18, "k"), (20, "m")]


def test_no_blocking_host_to_device_tensors_in_the_library():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        found += [f"{rel}:{line} in {function}" for line, function in _device_tensors(path.read_text())
                  if (rel, function) not in ALLOWED]
    assert not found, ("torch.tensor(..., device=...) copies from pageable memory and blocks the host; use "
                       "distcomm_attention._device.to_device / on_device: " + "; ".join(found))
