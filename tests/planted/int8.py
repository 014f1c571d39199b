"""Planted bugs of the int8 area: the weight-only int8 layer's products."""

from planted import Planted

INT8 = "src/gptlab/inference/int8.py"
EXACT = "tests/test_int8.py::test_the_bf16_product_of_prompts_rounds_x_and_the_sum_but_never_the_weights"

PLANTED = [
    Planted("int8: the bf16 prompt product rounds the weights themselves (q * scale to bf16, not q)", INT8,
            [("y = F.linear(x.to(torch.bfloat16), self.q.to(torch.bfloat16)).float() * self.scale",
              "y = F.linear(x.to(torch.bfloat16), self.dequantized().to(torch.bfloat16)).float()")],
            EXACT),
]
