"""Device memory at a fixed virtual address, backed by physical memory only while mapped.

The decode graphs read the KV cache at the address it had when they were captured. In
colocated training the engine frees its cache before every policy update (the update needs the
memory) and allocates a new one at the next rollout. The caching allocator then places it
wherever the driver hands out the next segment, which moves once the first optimizer step has
allocated Adam's state, and may move every step when ranks' histories differ: every graph is
captured again (MoE twin at EP 2 TP 2 + SP on 2 H200: 4 re-captures in every steady step).

CUDA's virtual memory management separates the address from the memory behind it: the engine
reserves an address range once, and each call maps physical memory into its start and unmaps
it when the call returns, so the memory still goes back to the driver between calls while the
address, and every graph, stays valid. The driver API is reached through ctypes (no build step).
``rollout.engine.kv_cache_memory`` chooses (:func:`plan_kv_cache_memory`).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import weakref

import torch

from megatron_grpo.ops.kernels import check_choice

_SUCCESS, _OUT_OF_MEMORY = 0, 2  # CUresult
_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_MINIMUM = 0  # CU_MEM_ALLOC_GRANULARITY_MINIMUM
_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):  # CUmemAllocationProp::allocFlags
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_P, _U64, _SIZE = ctypes.POINTER, ctypes.c_uint64, ctypes.c_size_t
_SIGNATURES = {
    "cuDeviceGet": [_P(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetAttribute": [_P(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuMemGetAllocationGranularity": [_P(_SIZE), _P(_Prop), ctypes.c_int],
    "cuMemAddressReserve": [_P(_U64), _SIZE, _SIZE, _U64, ctypes.c_ulonglong],
    "cuMemAddressFree": [_U64, _SIZE],
    "cuMemCreate": [_P(_U64), _SIZE, _P(_Prop), ctypes.c_ulonglong],
    "cuMemRelease": [_U64],
    "cuMemMap": [_U64, _SIZE, _SIZE, _U64, ctypes.c_ulonglong],
    "cuMemUnmap": [_U64, _SIZE],
    "cuMemSetAccess": [_U64, _SIZE, _P(_AccessDesc), _SIZE],
    "cuGetErrorName": [ctypes.c_int, _P(ctypes.c_char_p)],
}


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library with typed entry points, or None where it does not load."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(result: int, call: str) -> None:
    if result == _SUCCESS:
        return
    if result == _OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(f"{call}: CUDA out of memory")
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(result, ctypes.byref(name))
    raise RuntimeError(f"{call} failed: CUDA error {result} ({(name.value or b'?').decode()})")


def unsupported(device: torch.device) -> str:
    """Why memory cannot be mapped at a fixed address on ``device`` ("" when it can)."""
    if device.type != "cuda" or torch.version.hip:
        return "needs a CUDA device"
    lib = _driver()
    if lib is None:
        return "the CUDA driver library (libcuda.so.1) does not load"
    dev, value = ctypes.c_int(), ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), _index(device)), "cuDeviceGet")
    _check(lib.cuDeviceGetAttribute(ctypes.byref(value), _VMM_SUPPORTED, dev), "cuDeviceGetAttr")
    return "" if value.value else "the driver does not manage virtual memory on this GPU"


def plan_kv_cache_memory(choice: str, device: torch.device, graphs: bool) -> tuple[bool, str]:
    """Whether the engine's KV cache lives at a fixed address (``rollout.engine.kv_cache_memory``)
    and, for ``auto``, why not where it would ("" otherwise). ``auto``: fixed wherever decode
    graphs are on (only they read the address) and the driver can; ``fixed_address`` where it
    cannot is an error naming the field; ``allocator``: PyTorch's caching allocator."""
    check_choice("kv_cache_memory", choice, "rollout.engine.kv_cache_memory")
    if choice == "allocator" or (choice == "auto" and not graphs):
        return False, ""
    why = unsupported(device)
    if choice == "fixed_address" and why:
        raise ValueError(f"rollout.engine.kv_cache_memory: fixed_address {why}; use auto")
    return not why, f"allocator ({why})" if why else ""


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _Mapped:
    """What a tensor over the mapped memory keeps alive (torch holds the object it was made from
    until the storage dies): while one exists, some tensor still views the memory."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class FixedAddressMemory:
    """One reserved address range of ``capacity`` bytes on ``device``. :meth:`map` backs its
    start with physical memory and returns it as a tensor; :meth:`unmap` gives the memory back
    to the driver. The address (``address``) is the same for every mapping."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        why = unsupported(device)
        if why:
            raise RuntimeError(f"memory at a fixed address {why}")
        self.device, index, lib = device, _index(device), _driver()
        self._prop = _Prop(type=_ALLOCATION_PINNED, location=_Location(_LOCATION_DEVICE, index))
        self._access = _AccessDesc(_Location(_LOCATION_DEVICE, index), _ACCESS_READ_WRITE)
        granularity = _SIZE()
        _check(
            lib.cuMemGetAllocationGranularity(
                ctypes.byref(granularity), ctypes.byref(self._prop), _GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
        self.granularity = granularity.value
        self.capacity = _round_up(capacity, self.granularity)
        base = _U64()
        _check(lib.cuMemAddressReserve(ctypes.byref(base), self.capacity, 0, 0, 0), "reserve")
        self.address = base.value
        self._handle: int | None = None
        self._size = 0
        self._owner: weakref.ref | None = None

    @property
    def mapped(self) -> int:
        """Bytes backed by physical memory now (0 when unmapped)."""
        return self._size

    def map(self, nbytes: int) -> torch.Tensor:
        """``[nbytes]`` uint8 at ``address``, backed by new physical memory (contents undefined).
        A previous mapping is unmapped first; an error while a tensor still views it."""
        size = _round_up(max(nbytes, 1), self.granularity)
        if size > self.capacity:
            raise ValueError(f"{nbytes} bytes exceed the reserved {self.capacity}")
        if not self.unmap():
            raise RuntimeError("the fixed-address memory is still viewed by a tensor")
        lib, handle = _driver(), _U64()
        _check(lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self._prop), 0), "create")
        try:
            _check(lib.cuMemMap(self.address, size, 0, handle.value, 0), "cuMemMap")
            try:
                _check(
                    lib.cuMemSetAccess(self.address, size, ctypes.byref(self._access), 1), "access"
                )
            except Exception:
                lib.cuMemUnmap(self.address, size)
                raise
        except Exception:
            lib.cuMemRelease(handle.value)
            raise
        self._handle, self._size = handle.value, size
        owner = _Mapped(self.address, nbytes)
        self._owner = weakref.ref(owner)
        return torch.as_tensor(owner, device=self.device)

    def unmap(self) -> bool:
        """Give the physical memory back to the driver once no tensor views it (a garbage
        collection runs first if one does). Returns False, leaving it mapped, while one does."""
        if self._handle is None:
            return True
        if self._owner() is not None:
            gc.collect()
            if self._owner() is not None:
                return False
        torch.cuda.synchronize(self.device)  # no queued kernel may touch it after the unmap
        lib = _driver()
        _check(lib.cuMemUnmap(self.address, self._size), "cuMemUnmap")
        _check(lib.cuMemRelease(self._handle), "cuMemRelease")
        self._handle, self._size = None, 0
        return True

    def close(self) -> None:
        """Unmap and free the address range (left reserved while a tensor still views it)."""
        if self.address and self.unmap():
            _check(_driver().cuMemAddressFree(self.address, self.capacity), "cuMemAddressFree")
            self.address = 0

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass
