"""Small models for the shared DeepSpeed example configs: BERT and GPT-2 built by transformers from
a config (random weights, no download) with the module names those configs' regexes select, and a
CIFAR-style ResNet for the channel-pruning config."""

import torch
import torch.nn as nn


def make_bert(seed=0, layers=2):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=96,
        hidden_size=96,
        num_hidden_layers=layers,
        num_attention_heads=12,
        intermediate_size=384,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(cfg).eval()


def make_gpt2(seed=0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=96, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1)
        self.layer1 = nn.Sequential(Block(c), Block(c))
        self.layer2 = nn.Sequential(Block(c))
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(torch.relu(self.conv1(x))))
        return self.fc(x.mean((2, 3)))
