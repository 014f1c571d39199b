"""Planted bugs of the int8 area: quantization, the weight-only int8 layer's products, the tied embedding."""

from planted import Planted

INT8 = "src/gptlab/inference/int8.py"
TESTS = "tests/test_int8.py"
EXACT = f"{TESTS}::test_the_bf16_product_of_prompts_rounds_x_and_the_sum_but_never_the_weights"
ROUND_TRIP = f"{TESTS}::test_quantized_rows_round_trip_within_half_a_step"
DISPATCH = f"{TESTS}::test_prompts_take_the_bf16_product_where_the_cpu_computes_bf16_and_decode_steps_never"
TIED = f"{TESTS}::test_the_int8_torch_path_stays_near_fp32_and_ties_embedding_and_head"

PLANTED = [
    Planted("int8: the bf16 prompt product rounds the weights themselves (q * scale to bf16, not q)", INT8,
            "Int8Linear.forward_bf16",
            [("y = F.linear(x.to(torch.bfloat16), self.q.to(torch.bfloat16)).float() * self.scale",
              "y = F.linear(x.to(torch.bfloat16), self.dequantized().to(torch.bfloat16)).float()")],
            EXACT),
    Planted("int8: the bf16 prompt product leaves out the bias", INT8, "Int8Linear.forward_bf16",
            [("return y if self.bias is None else y + self.bias", "return y")],
            EXACT),
    Planted("int8: weights truncated toward zero instead of rounded", INT8, "quantize_rows",
            [("q = torch.round(w / divisor[:, None])", "q = torch.trunc(w / divisor[:, None])")],
            ROUND_TRIP),
    Planted("int8: each row's scale its largest weight over 128, not 127 (that weight clamped to 127)", INT8,
            "quantize_rows", [("scale = w.abs().amax(dim=1) / QMAX", "scale = w.abs().amax(dim=1) / (QMAX + 1)")],
            ROUND_TRIP),
    Planted("int8: a prompt of exactly bf16_rows rows multiplied in fp32", INT8, "Int8Linear.forward",
            [("x.numel() >= self.bf16_rows * self.in_features", "x.numel() > self.bf16_rows * self.in_features")],
            DISPATCH),
    Planted("int8: the token embedding keeps its fp32 weights while the head is quantized", INT8, "quantize_model",
            [("wte.weight = nn.Parameter(model.lm_head.dequantized(), requires_grad=False)",
              "wte.weight = nn.Parameter(wte.weight.detach().clone(), requires_grad=False)")],
            TIED),
]
