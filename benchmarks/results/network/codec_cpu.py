import time, torch
torch.set_num_threads(1)
from superneurons.compress.torch_hooks import resolve_spec
from superneurons.models import build_model, model_input, default_loss
m=build_model('fc-heavy'); x,y=model_input('fc-heavy',32); l=default_loss('fc-heavy')
n=sum(p.numel() for p in m.parameters())
opt=torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
for i in range(3):
    t=time.process_time(); opt.zero_grad(); l(m(x),y).backward(); opt.step(); c=time.process_time()-t
print(f"params {n} compute step cpu {c:.3f}s")
bucket=25*2**20//4
sizes=[]; left=n
while left>0: sizes.append(min(bucket,left)); left-=sizes[-1]
for spec in ['fft','topk','qsgd','terngrad','signsgd']:
    codec=resolve_spec(spec)
    enc=dec=0.0
    for s in sizes:
        g=torch.randn(s)*1e-3
        t=time.process_time(); p1=codec.encode(g); enc+=time.process_time()-t
        p2=codec.encode(torch.randn(s)*1e-3)
        t=time.process_time(); codec.decode_sum([p1,p2]); dec+=time.process_time()-t
    pb=sum(codec.payload_bytes(s) for s in sizes)
    print(f"{spec:10s} encode {enc:.3f}s decode_sum(2) {dec:.3f}s payload {pb/1e6:.2f}MB CR {4*n/pb:.1f} wire@96Mbit {pb*8/96e6:.3f}s wire@964Mbit {pb*8/964e6:.3f}s")
