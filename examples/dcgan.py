"""A DCGAN, shaped like the script people copy, recorded with retrolog.

Two models (a generator and a discriminator with batch norm), two Adam
optimizers, a BCE loss, a fixed noise batch, and per step one discriminator
update on a real and a fake batch followed by one generator update. The
"images" are synthetic 16x16 blobs (a Gaussian bump at a random place), so it
needs no download and an epoch takes about half a second on a CPU.

    python examples/dcgan.py --lr 0.0002 --niter 4 --manualSeed 1
"""

import argparse

import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

import retrolog as rl


def blobs(n, generator, size=16):
    """``n`` single-channel images in [-1, 1], each a Gaussian bump at a random centre."""
    grid = torch.arange(size, dtype=torch.float32)
    centres = 3 + (size - 6) * torch.rand(n, 2, generator=generator)
    widths = 1.5 + 1.5 * torch.rand(n, 1, 1, generator=generator)
    dy = (grid.view(1, size, 1) - centres[:, 0].view(n, 1, 1)) ** 2
    dx = (grid.view(1, 1, size) - centres[:, 1].view(n, 1, 1)) ** 2
    return (2 * torch.exp(-(dy + dx) / (2 * widths**2)) - 1).unsqueeze(1)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, nz, ngf):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),  # 4x4
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),  # 8x8
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, 1, 4, 2, 1, bias=False),  # 16x16
            nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ndf):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, ndf, 4, 2, 1, bias=False),  # 8x8
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),  # 4x4
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def main():
    parser = argparse.ArgumentParser(description="DCGAN on synthetic blobs")
    parser.add_argument("--batchSize", type=int, default=64, help="input batch size")
    parser.add_argument("--nz", type=int, default=32, help="size of the latent z vector")
    parser.add_argument("--ngf", type=int, default=32)
    parser.add_argument("--ndf", type=int, default=32)
    parser.add_argument("--niter", type=int, default=4, help="number of epochs to train for")
    parser.add_argument("--lr", type=float, default=0.0002, help="learning rate")
    parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam")
    parser.add_argument("--images", type=int, default=1024, help="training images")
    parser.add_argument("--manualSeed", type=int, default=1, help="manual seed")
    opt = parser.parse_args()

    torch.manual_seed(opt.manualSeed)
    dataset = TensorDataset(blobs(opt.images, torch.Generator().manual_seed(opt.manualSeed)))
    dataloader = DataLoader(dataset, batch_size=opt.batchSize, shuffle=True)

    netG = Generator(opt.nz, opt.ngf)
    netG.apply(weights_init)
    netD = Discriminator(opt.ndf)
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    fixed_noise = torch.randn(opt.batchSize, opt.nz, 1, 1)
    real_label = 1.0
    fake_label = 0.0
    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

    with rl.checkpointing(netG=netG, netD=netD, optimizerG=optimizerG, optimizerD=optimizerD):
        for epoch in rl.loop("epoch", range(opt.niter)):
            for i, (real,) in enumerate(rl.loop("step", dataloader)):
                # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
                netD.zero_grad()
                batch_size = real.size(0)
                label = torch.full((batch_size,), real_label)
                output = netD(real)
                errD_real = criterion(output, label)
                errD_real.backward()
                D_x = output.mean().item()

                noise = torch.randn(batch_size, opt.nz, 1, 1)
                fake = netG(noise)
                label.fill_(fake_label)
                output = netD(fake.detach())
                errD_fake = criterion(output, label)
                errD_fake.backward()
                D_G_z1 = output.mean().item()
                errD = errD_real + errD_fake
                optimizerD.step()

                # (2) Update G: maximize log(D(G(z)))
                netG.zero_grad()
                label.fill_(real_label)  # fake labels are real for generator cost
                output = netD(fake)
                errG = criterion(output, label)
                errG.backward()
                D_G_z2 = output.mean().item()
                optimizerG.step()

                rl.log("loss_D", errD.item())
                rl.log("loss_G", errG.item())
                if i % 8 == 0:
                    print(
                        f"[{epoch}/{opt.niter}][{i}/{len(dataloader)}] Loss_D: {errD.item():.4f} "
                        f"Loss_G: {errG.item():.4f} D(x): {D_x:.4f} "
                        f"D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}"
                    )
            with torch.no_grad():
                fake = netG(fixed_noise)
            rl.log("fake_mean", fake.mean().item())


if __name__ == "__main__":
    main()
