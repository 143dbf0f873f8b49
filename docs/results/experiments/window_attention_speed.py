"""One Qwen2.5-0.5B-shaped window layer's attention at 4,096 tokens (14 heads, 2 KV heads, d 64, bf16, 2 threads): the
dense window mask, the causal kernel, and apply.windowed_attention side by side (docs/results/window.md)."""
import time, torch
from nbl_gguf.calibration.apply import windowed_attention, window_visible
torch.set_num_threads(2)
n=4096
q=torch.randn(1,14,n,64,dtype=torch.bfloat16); k=torch.randn(1,2,n,64,dtype=torch.bfloat16); v=torch.randn_like(k)
pos=torch.arange(n); vis=window_visible(pos,pos,512,4)
mask=torch.zeros(n,n,dtype=torch.bfloat16).masked_fill(~vis, torch.finfo(torch.bfloat16).min)[None,None]
def dense(): return torch.nn.functional.scaled_dot_product_attention(q,k.repeat_interleave(7,1),v.repeat_interleave(7,1),attn_mask=mask)
def causal(): return torch.nn.functional.scaled_dot_product_attention(q,k.repeat_interleave(7,1),v.repeat_interleave(7,1),is_causal=True)
def blocked(): return windowed_attention(q,k,v,512,4)
for name,f in (("dense",dense),("causal",causal),("blocked",blocked))*2:
    t=time.perf_counter(); f(); f(); print(name, round((time.perf_counter()-t)/2,3))
print((dense().float()-blocked().float()).abs().max())
