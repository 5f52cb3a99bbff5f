"""Small reference models, offline data loaders and training recipes for qcompress.

`models.SmallCNN` (28x28 images), `data.load_fashion_mnist` (Debian `dataset-fashion-mnist`),
`data.load_digits` (scikit-learn's 8x8 digits, for fast tests) and the `demo_fashion_mnist`
recipe behind `make demo` and `qcompress train`.
"""
