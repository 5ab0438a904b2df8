from engines.loading import load_mlx_model


def test_weights_load_once_per_path(tiny_model):
    a = load_mlx_model(str(tiny_model))
    b = load_mlx_model(str(tiny_model) + "/")  # same directory, spelled differently
    assert a is b and a.model is b.model
    assert a.vocab_size == 2048
