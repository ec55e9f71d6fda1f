"""A stub of ray, named as such, for ``benchmarks/distributed/verl_engine_gpu.py`` on the GPU machine only.

veRL 0.9 imports ray when its protocol module loads (``verl.protocol``: ``ray.ObjectRef`` in a type check);
one process running the engine's forward/backward never calls it, and ray's wheel is larger than what can be
carried to that machine. Any attribute is a placeholder: calling one raises, naming it.
"""


class _Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"ray stub: ray.{self._name} was called; the real ray is not installed here")

    def __getattr__(self, item: str) -> "_Placeholder":
        return _Placeholder(f"{self._name}.{item}")


class ObjectRef:  # isinstance(x, ray.ObjectRef) is False for everything
    pass


def __getattr__(name: str) -> _Placeholder:
    return _Placeholder(name)
