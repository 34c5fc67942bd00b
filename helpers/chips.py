"""The TPU chips on this machine, as TorchTPU finds them: read from sysfs without touching any TPU client (nor
importing torch), so asking is cheap and safe anywhere, before torch loads."""

from __future__ import annotations

import glob
import os

GOOGLE_PCI_VENDOR = "0x1ae0"
# TorchTPU 0.2.0's own table (torch_tpu/_internal/utils/hardware.py) of the chips it drives, by PCI device id.
# The vendor id alone is not a TPU: Google's gVNIC network card (device 0x0042) reports it too.
TPU_PCI_DEVICES = {"0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e", "0x006f": "v6e", "0x0076": "v7"}
# Older TPUs, named only to say why TorchTPU 0.2.0 does not use them.
OLDER_TPU_PCI_DEVICES = {"0x0027": "v2 or v3", "0x0056": "a TPU of device id 0x0056"}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def tpu_scan(root: str = "/sys/bus/pci/devices", vfio: str = "/dev/vfio") -> tuple[list[str], list[str]]:
    """The chips TorchTPU can drive, by kind (``["v5e"]`` on a Colab v5e-1), and why not for each other TPU. As
    the wheel reads sysfs: a chip in TorchTPU's table whose IOMMU group has a ``/dev/vfio`` node."""
    chips, not_driven = [], []
    for device in sorted(glob.glob(os.path.join(root, "*"))):
        if _read(os.path.join(device, "vendor")) != GOOGLE_PCI_VENDOR:
            continue
        device_id, where = _read(os.path.join(device, "device")), os.path.basename(device)
        if device_id in OLDER_TPU_PCI_DEVICES:
            not_driven.append(
                f"{where}: TPU {OLDER_TPU_PCI_DEVICES[device_id]} (device {device_id}), which TorchTPU 0.2.0 "
                f"does not drive (it drives {', '.join(TPU_PCI_DEVICES.values())})"
            )
        if device_id not in TPU_PCI_DEVICES:
            continue
        try:  # TorchTPU opens the chip through VFIO: no device node, no TPU
            group = os.path.basename(os.readlink(os.path.join(device, "iommu_group")))
        except OSError:
            group = None
        if group is None or not os.path.exists(os.path.join(vfio, group)):
            node = f"/dev/vfio/{group}" if group else "an IOMMU group"
            not_driven.append(f"{where}: TPU {TPU_PCI_DEVICES[device_id]} without {node}, which TorchTPU needs")
            continue
        chips.append(TPU_PCI_DEVICES[device_id])
    return chips, not_driven


def tpu_chips(root: str = "/sys/bus/pci/devices", vfio: str = "/dev/vfio") -> list[str]:
    """The TPU chips TorchTPU can drive on this machine, by kind (see ``tpu_scan``)."""
    return tpu_scan(root, vfio)[0]
