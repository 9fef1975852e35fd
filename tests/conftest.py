"""pytester for the plugin tests; torch's lazy imports done once, up front.

pytester's in-process runs drop the modules they imported when they end;
torch._dynamo (imported lazily by optimizers and checkpoint) registers
operator libraries that cannot be registered twice, so it must be imported
before the first inner run.
"""

import torch._dynamo  # noqa: F401
import torch.utils.checkpoint  # noqa: F401

pytest_plugins = ["pytester"]
