from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.apps.django_shop.shop"
    label = "shop"
