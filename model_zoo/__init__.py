"""Small reference models, offline data loaders and training recipes for qcompress.

`models.SmallCNN` (28x28 images), `data.load_fashion_mnist` (Debian `dataset-fashion-mnist`),
`data.load_digits` (scikit-learn's 8x8 digits, for fast tests), and the two demos: `demo_bbc`
(`make demo`: `qcompress train` on a pretrained MiniLM and the BBC News topics) and
`demo_fashion_mnist` (`make demo-cnn`: a plain training loop around the CompressionScheduler).
"""
