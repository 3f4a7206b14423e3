# Stand-in for torchvision (wheels pin one torch build): SGLang/transformers import it; never called here.
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.30.0"


class _Missing:
    """Any name of the stand-in: attribute access works, calling it fails."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is not available (torchvision stand-in)")

    def __repr__(self):
        return f"<torchvision stand-in {self._name}>"


class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"torchvision.{name}")
