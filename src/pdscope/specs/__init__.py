"""Facts: devices, model shapes, precisions. Data files where possible; no arithmetic here."""

from pdscope.specs.devices import SEED_DEVICES, Device, catalog, get_device, resolve_device
from pdscope.specs.errors import SpecError
from pdscope.specs.models import ModelSpec, load_model, preset_names, spec_from_config
from pdscope.specs.precisions import (
    KVPrecision,
    WeightPrecision,
    get_kv_precision,
    get_weight_precision,
)

__all__ = [
    "SEED_DEVICES",
    "Device",
    "KVPrecision",
    "ModelSpec",
    "SpecError",
    "WeightPrecision",
    "catalog",
    "get_device",
    "get_kv_precision",
    "get_weight_precision",
    "load_model",
    "preset_names",
    "resolve_device",
    "spec_from_config",
]
