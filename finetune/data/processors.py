"""A vision-language model's processor, loaded for images only (finetune.data.images.Pictures holds it): the class
AutoProcessor names, built without the video processor its class may also take (transformers builds those only with
torchvision, and images need none), or imported with its PIL image processor where transformers hides the class for
want of torchvision (Mistral 3's Pixtral). A processor that needs torchvision, or another package, for images is
refused naming it.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from finetune.config import ConfigError


def load_processor(source: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The model's own processor (the class AutoProcessor picks), for images only: where its class also takes a video
    processor, which transformers builds only with torchvision, a subclass without one (images need none); where
    transformers hides the class itself for want of torchvision, the class with PIL image processing
    (`_processor_class`: Mistral 3's Pixtral). A processor that needs torchvision for images too is refused naming the
    package."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.utils import is_torchvision_available

    config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    name = _declared_processor(source) or PROCESSOR_MAPPING_NAMES.get(config.model_type)
    cls = _processor_class(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"model.path={source}: transformers has no processor for model_type={config.model_type} (it names "
                          f"{name!r}), which reads its images: a vision-language model needs one")
    if not is_torchvision_available() and "video_processor" in inspect.signature(cls.__init__).parameters:
        cls = _without_video(cls)
    try:
        return cls.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except ImportError as e:
        if "orchvision" in str(e):
            raise ConfigError(f"model.path={source}: {cls.__name__} (model_type={config.model_type}) needs torchvision to process "
                              "images, which is not installed here: pip install torchvision (the build matching your torch: "
                              "PyPI's wheel is CUDA torch's)") from None
        raise ConfigError(f"model.path={source}: {cls.__name__} cannot be built: {str(e).splitlines()[0]}") from None
    except OSError as e:
        raise ConfigError(f"model.path={source}: could not load its processor ({cls.__name__}): {str(e).splitlines()[0]}: a "
                          "vision-language model's directory holds its processor (processor_config.json or "
                          "preprocessor_config.json)") from None


def _processor_class(name: str) -> Any:
    """transformers' processor class `name`. Where transformers hides it for want of torchvision although it reads
    images without it (Mistral 3's PixtralProcessor: its module imports the torchvision image processor's module for a
    helper its PIL twin has too), the class itself, its module imported with each torchvision image processor's module
    of the model's package replaced by its PIL twin (image_processing_pil_*), which AutoImageProcessor picks here anyway.
    Anything else that needs torchvision stays hidden (its refusal names the package)."""
    import importlib
    import pkgutil
    import sys

    import transformers
    from transformers.utils.import_utils import DummyObject

    cls = getattr(transformers, name, None)
    where = getattr(transformers, "_class_to_module", {}).get(name)
    if not isinstance(cls, DummyObject) or list(getattr(cls, "_backends", ())) != ["torchvision"] or where is None:
        return cls
    package = importlib.import_module(f"transformers.{where.rsplit('.', 1)[0]}")
    found = {m.name for m in pkgutil.iter_modules(package.__path__)}
    twins = {f"{package.__name__}.{m}": f"{package.__name__}.image_processing_pil_{m[len('image_processing_'):]}" for m in found
             if m.startswith("image_processing_") and f"image_processing_pil_{m[len('image_processing_'):]}" in found}
    added = [m for m in twins if m not in sys.modules]
    try:
        for module in added:
            sys.modules[module] = importlib.import_module(twins[module])
        return getattr(importlib.import_module(f"transformers.{where}"), name)
    except ImportError:
        return cls
    finally:
        for module in added:  # the torchvision modules themselves still fail to import, as they should
            sys.modules.pop(module, None)


def has_processor(source: str) -> bool:
    """Whether a local model directory holds a processor's files."""
    return any((Path(source).expanduser() / f).is_file() for f in ("processor_config.json", "preprocessor_config.json"))


def _declared_processor(source: str) -> str | None:
    """The processor class a local model directory's files name (as AutoProcessor reads them)."""
    import json

    for file in ("processor_config.json", "preprocessor_config.json"):
        path = Path(source).expanduser() / file
        if path.is_file():
            name = json.loads(path.read_text()).get("processor_class")
            if isinstance(name, str):
                return name
    return None


_WITHOUT_VIDEO: dict[type, type] = {}


def _without_video(cls: type) -> type:
    """`cls` with no video processor: transformers' ProcessorMixin reads its attributes from __init__'s signature and
    checks a video processor's class against one that exists only with torchvision (an AttributeError otherwise). Its
    own settings (SmolVLM's image_seq_len, InternVL's image_seq_length) are read from its files by the names of
    __init__'s arguments (its code's variable names), so the subclass's __init__ takes the same ones, less the video
    processor's."""
    if cls not in _WITHOUT_VIDEO:
        taken = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
                 if name not in ("self", "video_processor") and p.kind is p.POSITIONAL_OR_KEYWORD}
        defaults = {name: None if value is inspect.Parameter.empty else value for name, value in taken.items()}
        source = (f"def __init__(self, {''.join(f'{n}=_defaults[{n!r}], ' for n in taken)}**kwargs):\n"
                  f"    _cls.__init__(self, {''.join(f'{n}={n}, ' for n in taken)}video_processor=None, **kwargs)\n")
        namespace: dict[str, Any] = {"_cls": cls, "_defaults": defaults}
        exec(source, namespace)  # a function whose arguments are named as the class's
        _WITHOUT_VIDEO[cls] = type(cls.__name__, (cls,), {"__init__": namespace["__init__"], "__module__": cls.__module__})
    return _WITHOUT_VIDEO[cls]
