"""A fast reader for GGUF files: header and metadata parsed directly, tensor data memory-mapped.

``gguf.GGUFReader`` builds a Python object per metadata array element and takes seconds to open a file
with a 49k-token vocabulary; this reader opens it in a fraction of that, then hands each tensor's raw
bytes to ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from jaxllm.loading.dequantize import dequantize
from jaxllm.loading.errors import LoadError
from jaxllm.loading.gguf_quant import FORMATS, repack
from jaxllm.loading.quantize import HostQuantized

# The quantization types jaxllm dequantizes at load time.
SUPPORTED_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K, GGMLQuantizationType.MXFP4,
})

# value type -> struct format (little-endian); numpy reads arrays of the same formats.
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dims fastest-first)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise LoadError(f"{self.path}: no such GGUF file")
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._view = memoryview(self._data)  # header reads: slicing the memmap itself makes an array per string
        self._pos = 0
        try:
            self._parse()
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
            raise LoadError(f"{self.path}: corrupt or truncated GGUF header ({e})") from None

    # -- low-level reads
    def _read(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._data):
            raise ValueError("unexpected end of file")
        (value,) = struct.unpack_from(fmt, self._view, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        if self._pos + n > len(self._data):
            raise ValueError("unexpected end of file")
        s = str(self._view[self._pos:self._pos + n], "utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            etype, n = GGUFValueType(self._read("<I")), self._read("<Q")
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype])
                arr = np.frombuffer(self._data, dt, n, self._pos).copy()
                self._pos += n * dt.itemsize
                return arr
            return [self._value(etype) for _ in range(n)]
        return self._read(_SCALARS[vtype])

    def _parse(self) -> None:
        if bytes(self._data[:4]) != b"GGUF":
            raise LoadError(f"{self.path}: not a GGUF file (bad magic)")
        self._pos = 4
        self.version = self._read("<I")
        if self.version not in (2, 3):
            raise LoadError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            raw_infos.append((name, tuple(reversed(dims)), self._read("<I"), self._read("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in raw_infos:
            try:
                qtype = GGMLQuantizationType(qtype)
            except ValueError:
                raise LoadError(f"{self.path}: tensor {name!r} has unknown GGML type {qtype}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * type_size
            self.tensors[name] = TensorInfo(name, shape, qtype, data_start + offset, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (uint8, memory-mapped)."""
        info = self.tensors[name]
        if info.offset + info.nbytes > len(self._data):
            raise LoadError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated file?)")
        return self._data[info.offset:info.offset + info.nbytes]

    def load_quantized(self, name: str) -> HostQuantized:
        """A tensor of a type kept quantized (`gguf_quant.FORMATS`), repacked, not dequantized."""
        info = self.tensors[name]
        return HostQuantized(repack(np.asarray(self.raw(name)), info.qtype, info.shape), FORMATS[info.qtype],
                             info.shape)

    def load(self, name: str) -> np.ndarray:
        """The tensor, dequantized to float32 (or kept as float16/bfloat16), in numpy shape order."""
        info = self.tensors[name]
        if info.qtype not in SUPPORTED_TYPES:
            raise LoadError(f"{self.path}: tensor {name!r} uses quantization type {info.qtype.name}, which is not "
                            f"supported (supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
        if info.offset + info.nbytes > len(self._data):
            raise LoadError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated file?)")
        raw = self._data[info.offset:info.offset + info.nbytes]
        # Copies, not views of the mapped file: a device array may alias its host buffer (zero-copy on CPU) and
        # would keep the whole file's mapping resident.
        if info.qtype == GGMLQuantizationType.F32:
            return np.array(raw.view(np.float32).reshape(info.shape))
        if info.qtype == GGMLQuantizationType.F16:
            return np.array(raw.view(np.float16).reshape(info.shape))
        return dequantize(np.asarray(raw), info.qtype, info.shape)
