import subprocess, sys
cases = {
 "conv1d channels cpu": "gp.conv1d(torch.randn(2,3,8), torch.randn(4,2))",
 "conv1d channels cuda": "gp.conv1d(torch.randn(2,3,8,device='cuda'), torch.randn(4,2,device='cuda'))",
 "conv1d wdim cuda": "gp.conv1d(torch.randn(2,3,8,device='cuda'), torch.randn(3,device='cuda'))",
 "emb 2d cpu": "gp.embedding(torch.tensor([1]), torch.randn(5))",
 "emb 2d cuda": "gp.embedding(torch.tensor([1],device='cuda'), torch.randn(5,device='cuda'))",
 "emb pad cuda": "gp.embedding(torch.tensor([1],device='cuda'), torch.randn(5,4,device='cuda'), 7)",
 "softmax dim cuda": "gp.softmax(torch.randn(3,4,device='cuda'), dim=5)",
 "ln H cuda": "gp.layer_norm(torch.randn(3,4,device='cuda'), torch.randn(5,device='cuda'), torch.randn(5,device='cuda'))",
 "torch check cuda": "torch.ops.aten.view(torch.randn(3,device='cuda'), [7])",
}
for k, v in cases.items():
    p = subprocess.run([sys.executable, "-c", f"import torch, gpu_puzzles as gp\ntry:\n    {v}\nexcept Exception as e: print('raised', type(e).__name__, str(e).splitlines()[0][:90])"], capture_output=True, text=True)
    print(f"{k:20s} rc={p.returncode} {p.stdout.strip()[:120]}")
